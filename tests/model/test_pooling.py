"""How a model directory says its embeddings are made (``model/pooling.py``): sentence-transformers' modules, the
defaults without them, Matryoshka dimensions, and what is refused rather than served wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boundless.model.pooling import EmbeddingPooling, read_pooling


def _modules(path: Path, *types: str, pooling: dict | None = None) -> Path:
    path.mkdir(exist_ok=True)
    modules = [
        {"idx": i, "name": str(i), "path": f"{i}_{t}", "type": f"sentence_transformers.models.{t}"}
        for i, t in enumerate(types)
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    for i, t in enumerate(types):
        if t == "Pooling":
            (path / f"{i}_{t}").mkdir(exist_ok=True)
            (path / f"{i}_{t}" / "config.json").write_text(json.dumps(pooling or {}))
    return path


def test_without_modules_a_decoder_pools_its_last_token_normalized(tmp_path: Path) -> None:
    pooling = read_pooling(tmp_path, {"matryoshka_dimensions": [32, 64]})
    assert pooling == EmbeddingPooling("last", True, True, (32, 64)) and pooling.served
    assert pooling.embedding([3.0, 4.0]) == pytest.approx([0.6, 0.8])
    assert pooling.embedding([3.0, 4.0], normalize=False) == [3.0, 4.0]  # (a request's own choice)
    assert pooling.embedding([3.0, 4.0, 12.0], dimensions=2) == pytest.approx([0.6, 0.8])  # (cut, then unit again)
    with pytest.raises(ValueError, match="dimensions 4 exceed the model's 3"):
        pooling.embedding([3.0, 4.0, 12.0], dimensions=4)


def test_sentence_transformers_modules_are_read(tmp_path: Path) -> None:
    last = read_pooling(
        _modules(tmp_path / "a", "Transformer", "Pooling", "Normalize", pooling={"pooling_mode_lasttoken": True})
    )
    assert last == EmbeddingPooling("last", True) and last.served
    raw = read_pooling(_modules(tmp_path / "b", "Transformer", "Pooling", pooling={"pooling_mode_lasttoken": True}))
    assert not raw.normalize and raw.embedding([3.0, 4.0]) == [3.0, 4.0]
    mean = read_pooling(_modules(tmp_path / "c", "Transformer", "Pooling", pooling={"pooling_mode_mean_tokens": True}))
    assert mean.kind == "mean" and mean.served and not mean.normalize
    cls = read_pooling(_modules(tmp_path / "e", "Transformer", "Pooling", pooling={"pooling_mode_cls_token": True}))
    assert cls.kind == "cls" and not cls.served and "pool by 'cls'" in cls.refusal()
    dense = read_pooling(
        _modules(
            tmp_path / "d", "Transformer", "Pooling", "Dense", "Normalize", pooling={"pooling_mode_lasttoken": True}
        )
    )
    assert dense.unapplied == ("Dense",) and not dense.served and "Dense" in dense.refusal()


def test_modules_that_do_not_read_leave_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "broken"
    path.mkdir()
    (path / "modules.json").write_text('[{"type": "sentence_transformers.models.Pooling", "path": "missing"}]')
    assert read_pooling(path) == EmbeddingPooling()
