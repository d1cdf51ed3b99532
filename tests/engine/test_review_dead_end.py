"""Dead-end grammar edge cases. Run: cd /tmp/wt-review2 && PYTHONPATH=. /work/main/.venv/bin/python -m pytest -q -p no:cacheprovider /tmp/review2/test_dead_end.py --rootdir=. -c pyproject.toml"""
import pytest
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.structured_output import StructuredOutput
from tests.engine.test_structured_output import _engine, _run

DEAD = StructuredOutput("regex", "a[^\\x00-\\U0010ffff]")


@pytest.mark.parametrize("extra", [{"ignore_eos": True}, {"min_tokens": 5}, {}])
@pytest.mark.parametrize("windows,spec", [(1, None), (4, None), (1, '{"method": "ngram", "num_speculative_tokens": 4}')])
def test_dead_end(tiny_llama, extra, windows, spec):
    core = _engine(tiny_llama, windows=windows, speculative=spec)
    prompt = tiny_llama.tokenizer.encode("Say something.")
    p = SamplingParams(temperature=0.0, structured=DEAD, max_tokens=10, **extra)
    out = _run(core, {"r": (prompt, p), "s": (prompt, SamplingParams(temperature=1.0, seed=2, structured=DEAD, max_tokens=10, n=1, **extra))})
    print(extra, windows, spec, out)
    for text, reason in out.values():
        assert text == "a", (text, reason)
