"""Engines of one cluster hold KV in one type (``--kv-cache-dtype``): their blocks move between them as bytes (a
handoff, a lending move), so an instance says what its cache holds and the front end refuses a mix in words. Handed
from an fp8_e4m3 prefill engine to an fp8_e5m2 decode engine (the same size), the blocks were taken whole and read as
other numbers; between an 8-bit and a 32-bit engine every handoff failed and was recomputed."""

from __future__ import annotations

import dataclasses

import pytest

from boundless.cluster.client import make_pd_dispatcher, require_one_kv_type
from boundless.cluster.instance import EngineInstance, InstanceInfo
from boundless.config import ClusterConfig, ConfigError
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel
from boundless.programs.process_table import ProcessTable


def _info(iid: str, role: str, kv_dtype: str, block_size: int = 16) -> InstanceInfo:
    return InstanceInfo(
        iid, 1, "node", 256, "cpu", role=role, kv_address=iid, block_size=block_size, kv_bytes_per_block=4096,
        fingerprint="f", kv_blocks=16, host_blocks=0, kv_dtype=kv_dtype,
    )  # fmt: skip


def test_an_instance_says_the_type_its_kv_cache_holds(tiny_llama: LoadedModel) -> None:
    for name, held in (("fp8", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2"), ("auto", "float32")):
        config = engine_config(tiny_llama.name, max_model_len=128, kv_cache_gb=0.01, kv_cache_dtype=name)
        inst = EngineInstance("0", config, 4, loaded=tiny_llama)
        try:
            assert inst.info().kv_dtype == held
        finally:
            inst.shutdown()


@pytest.mark.parametrize(
    ("prefill", "decode"), [(("float8_e4m3fn", 16), ("float8_e5m2", 16)), (("float8_e4m3fn", 16), ("float32", 16)),
                            (("float8_e4m3fn", 16), ("float8_e4m3fn", 32))],
)  # fmt: skip
def test_prefill_and_decode_engines_of_different_kv_types_are_refused_in_words(
    tiny_llama: LoadedModel, prefill: tuple[str, int], decode: tuple[str, int]
) -> None:
    infos = {"p0": _info("p0", "prefill", *prefill), "d0": _info("d0", "decode", *decode)}
    config = engine_config(tiny_llama.name, max_model_len=128, kv_cache_gb=0.01)
    cluster = ClusterConfig(prefill_instances=1, decode_instances=1)
    with pytest.raises(ConfigError, match="must hold KV in one type") as refused:
        make_pd_dispatcher(infos, config, cluster, ProcessTable())
    assert f"p0 {prefill[0]} in blocks of {prefill[1]}" in str(refused.value)
    assert f"d0 {decode[0]} in blocks of {decode[1]}" in str(refused.value)
    # Alike, they are taken.
    alike = {"p0": infos["p0"], "d0": dataclasses.replace(infos["p0"], instance_id="d0", role="decode")}
    assert make_pd_dispatcher(alike, config, cluster, ProcessTable()) is not None
    with pytest.raises(ConfigError, match="instances lending KV must hold KV in one type"):
        require_one_kv_type(infos, "instances lending KV")
