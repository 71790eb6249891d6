def test_list_models_in_openai_format(client, http, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    raw = http.get("/models").json()
    assert raw["object"] == "list"
    card = raw["data"][0]
    assert card["object"] == "model" and card["owned_by"] and isinstance(card["created"], int)


def test_models_tell_agents_the_context_and_what_the_model_can_do(http, model):
    """The context (vLLM's max_model_len, llama-server's meta), the longest answer, the
    capabilities, and the same model in Codex CLI's catalog format (`models`)."""
    raw = http.get("/models").json()
    card = raw["data"][0]
    assert card["max_model_len"] == card["meta"]["n_ctx"] == 2048  # the shared server's --ctx-size
    assert card["meta"]["n_ctx_train"] == 8192 and card["meta"]["n_vocab"] > 0 and card["meta"]["slots"] == 4
    assert card["max_output_tokens"] == 2048
    assert {"chat", "completions", "tools", "structured_outputs", "embeddings"} <= set(card["capabilities"])
    assert "reasoning" not in card["capabilities"]  # SmolLM2's template does not think
    [codex] = raw["models"]
    assert codex["slug"] == model and codex["context_window"] == 2048 and codex["visibility"] == "list"
    for required in ("display_name", "supported_reasoning_levels", "shell_type", "supported_in_api", "priority",
                     "support_verbosity", "truncation_policy", "experimental_supported_tools", "model_messages"):
        assert required in codex, required


def test_health(server, model):
    health = server.health()
    assert health["status"] == "ok"
    assert health["models"][model]["slots"] == 4
