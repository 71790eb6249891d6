"""Rerank (Jina's and Cohere's shape) served by a random-weight Qwen3-Reranker written by
`python -m fastrun_cpp.tiny_model --reranker`: rank pooling over its classifier head, the pairs
in its own prompt, scored through the embeddings queue. Random weights: the scores mean
nothing, but they are deterministic, ordered, per document, and the same in any batch."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.server import run_server

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital and largest city of France.", "Bananas are yellow when ripe.",
             "The Eiffel Tower stands in Paris.", "Berlin is the capital of Germany.",
             "France borders Spain, Italy and Germany."]


@pytest.fixture(scope="module")
def reranker_path(tmp_path_factory):
    """The generator as anyone runs it."""
    from fastrun_cpp.default_model import embedded_model_path

    out = tmp_path_factory.mktemp("reranker") / "tiny-reranker.gguf"
    subprocess.run([sys.executable, "-m", "fastrun_cpp.tiny_model", str(out), "--reranker",
                    "--like", str(embedded_model_path())], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def reranker(reranker_path, tmp_path_factory):
    with run_server("--model", str(reranker_path), "--slots", "1", "--ctx-size", "512",
                    log_dir=tmp_path_factory.mktemp("rerank-server")) as server:
        yield server, reranker_path.stem


def rerank(server, body: dict, path: str = "/v1/rerank") -> httpx.Response:
    return httpx.post(server.base_url.removesuffix("/v1") + path, json=body, timeout=120)


def test_documents_come_back_sorted_by_a_deterministic_score(reranker):
    server, model = reranker
    body = {"model": model, "query": QUERY, "documents": DOCUMENTS}
    first, again = rerank(server, body).json(), rerank(server, body).json()
    assert first["results"] == again["results"]
    scores = [result["relevance_score"] for result in first["results"]]
    assert scores == sorted(scores, reverse=True)
    assert sorted(result["index"] for result in first["results"]) == list(range(len(DOCUMENTS)))
    assert all(0 < score < 1 for score in scores)  # P("yes") of the softmaxed head
    assert len(set(scores)) == len(scores)  # different documents, different scores
    assert all(result["document"]["text"] == DOCUMENTS[result["index"]] for result in first["results"])
    assert first["model"] == model and first["id"].startswith("rerank")
    assert first["usage"]["prompt_tokens"] == first["usage"]["total_tokens"] > len(DOCUMENTS) * 40


def test_top_n_return_documents_and_document_objects(reranker):
    server, model = reranker
    full = rerank(server, {"model": model, "query": QUERY, "documents": DOCUMENTS}).json()["results"]
    top = rerank(server, {"model": model, "query": QUERY, "top_n": 2, "return_documents": False,
                          "documents": [{"text": text} for text in DOCUMENTS]}).json()["results"]
    assert top == [{"index": r["index"], "relevance_score": r["relevance_score"]} for r in full[:2]]
    # Cohere's v2 path leaves the documents out unless asked; llama-server's paths are the same API.
    v2 = rerank(server, {"model": model, "query": QUERY, "documents": DOCUMENTS}, "/v2/rerank").json()["results"]
    assert v2 == [{"index": r["index"], "relevance_score": r["relevance_score"]} for r in full]
    for path in ("/rerank", "/v1/reranking"):
        assert rerank(server, {"model": model, "query": QUERY, "documents": DOCUMENTS}, path).json()["results"] == full


def test_a_score_is_the_same_alone_as_among_others(reranker):
    server, model = reranker
    together = {r["index"]: r["relevance_score"] for r in rerank(
        server, {"model": model, "query": QUERY, "documents": DOCUMENTS}).json()["results"]}
    for index, document in enumerate(DOCUMENTS):
        alone = rerank(server, {"model": model, "query": QUERY, "documents": [document]}).json()["results"]
        assert alone[0]["relevance_score"] == together[index]
    other_query = rerank(server, {"model": model, "query": "Which fruit is yellow?", "documents": DOCUMENTS}).json()
    assert {r["index"]: r["relevance_score"] for r in other_query["results"]} != together


def test_a_pair_is_tokenized_whole_as_the_models_tokenizer_does(reranker, reranker_path):
    """The filled prompt is one text to the tokenizer, as the model saw its training pairs and
    as llama-server tokenizes them: " What" after "<Query>:" is one token, not two."""
    from fastrun_cpp.engine.model import LlamaModel

    server, model = reranker
    vocabulary = LlamaModel(reranker_path, vocab_only=True)
    try:
        filled = vocabulary.metadata("tokenizer.chat_template.rerank").replace("{query}", QUERY).replace(
            "{document}", DOCUMENTS[0])
        expected = vocabulary.tokenize(filled, add_special=True, parse_special=True)
    finally:
        vocabulary.close()
    usage = rerank(server, {"model": model, "query": QUERY, "documents": [DOCUMENTS[0]]}).json()["usage"]
    assert usage["prompt_tokens"] == len(expected)


def test_cohere_sdk_reranks_against_this_server(reranker):
    """Cohere's own client, from PyPI, sending its own request to /v2/rerank."""
    import cohere

    server, model = reranker
    client = cohere.ClientV2(api_key="unused", base_url=server.base_url.removesuffix("/v1"))
    response = client.rerank(model=model, query=QUERY, documents=DOCUMENTS, top_n=3)
    ours = rerank(server, {"model": model, "query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()["results"]
    assert [(r.index, r.relevance_score) for r in response.results] == [
        (r["index"], r["relevance_score"]) for r in ours]


def test_langchain_cohere_rerank_compresses_documents_in_the_servers_order(reranker):
    """LangChain's CohereRerank (langchain-cohere from PyPI) as a RAG pipeline uses it: a
    document compressor over LangChain Documents, pointed at this server by base_url."""
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    server, model = reranker
    compressor = CohereRerank(model=model, cohere_api_key="unused", top_n=3,
                              base_url=server.base_url.removesuffix("/v1"))
    documents = [Document(page_content=text, metadata={"source": index}) for index, text in enumerate(DOCUMENTS)]
    kept = compressor.compress_documents(documents, QUERY)
    ours = rerank(server, {"model": model, "query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()["results"]
    assert [(d.metadata["source"], d.metadata["relevance_score"]) for d in kept] == [
        (r["index"], r["relevance_score"]) for r in ours]
    assert [d.page_content for d in kept] == [DOCUMENTS[r["index"]] for r in ours]


def test_the_model_lists_rerank_and_nothing_it_cannot_do(reranker):
    server, model = reranker
    card = httpx.get(f"{server.base_url}/models/{model}", timeout=30).json()
    assert card["capabilities"] == ["rerank"]
    embeddings = httpx.post(f"{server.base_url}/embeddings", json={"model": model, "input": "x"}, timeout=30)
    assert embeddings.status_code == 400


@pytest.mark.parametrize("body, named", [
    ({"documents": ["a"] * 10_000}, "limit-rerank-documents"),
    ({"documents": ["word " * 600]}, "context window"),
    ({"documents": []}, "documents"),
    ({"documents": ["a"], "top_n": 0}, "top_n"),
    ({"documents": [{"title": "no text"}]}, "text"),
    ({"documents": ["a"], "query": 7}, "query"),
])
def test_hostile_rerank_requests_are_400s_that_name_the_limit(reranker, body, named):
    server, model = reranker
    response = rerank(server, {"model": model, "query": QUERY, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"], error
    assert rerank(server, {"model": model, "query": QUERY, "documents": ["still serving"]}).status_code == 200


def test_a_model_that_is_not_a_reranker_says_so(server, model):
    response = rerank(server, {"model": model, "query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 400
    assert "not a reranker" in response.json()["error"]["message"]
