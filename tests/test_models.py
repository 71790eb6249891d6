def test_list_models_in_openai_format(client, http, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    raw = http.get("/models").json()
    assert raw["object"] == "list"
    card = raw["data"][0]
    assert card["object"] == "model" and card["owned_by"] and isinstance(card["created"], int)


def test_health(server, model):
    health = server.health()
    assert health["status"] == "ok"
    assert health["models"][model]["slots"] == 4
