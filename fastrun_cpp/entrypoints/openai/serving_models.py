"""The models this server serves, and GET /v1/models."""

from __future__ import annotations

from dataclasses import dataclass

from fastrun_cpp.chat import ChatTemplate
from fastrun_cpp.engine import AsyncEngine
from fastrun_cpp.entrypoints.openai.errors import model_not_found
from fastrun_cpp.entrypoints.openai.protocol import ModelCard, ModelList


@dataclass
class ServedModel:
    id: str
    engine: AsyncEngine
    chat_template: ChatTemplate
    created: int


class OpenAIServingModels:
    def __init__(self, models: list[ServedModel]) -> None:
        self._models = {model.id: model for model in models}

    def get(self, model_id: str) -> ServedModel:
        model = self._models.get(model_id)
        if model is None:
            raise model_not_found(model_id)
        return model

    def load(self) -> dict[str, dict[str, object]]:
        load = {}
        for model in self._models.values():
            busy, waiting = model.engine.load()
            load[model.id] = {
                "slots": model.engine.slots,
                "busy_slots": busy,
                "waiting": waiting,
                "prompt_cache": vars(model.engine.stats).copy(),
            }
        return load

    def list_models(self) -> ModelList:
        return ModelList(
            data=[ModelCard(id=model.id, created=model.created) for model in self._models.values()]
        )
