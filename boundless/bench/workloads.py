"""Agent programs as data: which calls a program makes, in which threads, with what lengths.

Single-threaded programs (chat, ReAct-style tool loops) are a chain of calls whose prompt is the
conversation so far; multi-threaded ones fan out and join (map-reduce) or expand a search tree
in rounds of parallel branches (MCTS). Lengths follow the Autellix workload statistics and shrink
by ``scale`` to fit a CPU. Real agent sessions replay from ``../shared/traces/lmcache_agent_trace``.
Everything here is generated from a seed: the same arguments give the same programs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
from array import array
from dataclasses import dataclass, field
from pathlib import Path

# Autellix Table 1 / §6 workload statistics: (prompt tokens per call, output tokens per call, calls per program)
SHAREGPT = (256, 277, 6.66)
BFCL = (735, 34, 10.75)
LATS = (467, 73, 160.0)

WORKLOADS = ("chat", "react", "mapreduce", "mcts", "trace")
SHARED_SYSTEM_PROMPT = 48  # tokens every program starts with (prefix-cache hits across programs)
MULTI_THREADED = ("mapreduce", "mcts")


@dataclass(frozen=True)
class CallSpec:
    """One LLM call: it continues ``parents[0]``'s conversation (or starts from the system prompt),
    sees the outputs of the other parents, appends ``new_input`` tokens and generates ``output``."""

    thread_id: str
    parents: tuple[str, ...]
    new_input: int
    output: int
    tool_wait_s: float = 0.0  # a tool or user turn before the call


@dataclass
class ProgramSpec:
    """A program: stages run one after another; the calls of a stage run in parallel."""

    program_id: str
    arrival_s: float
    system_prompt: int
    stages: list[list[CallSpec]] = field(default_factory=list)

    @property
    def num_calls(self) -> int:
        return sum(len(s) for s in self.stages)

    @property
    def output_tokens(self) -> int:
        return sum(c.output for s in self.stages for c in s)

    @property
    def multi_threaded(self) -> bool:
        return any(len(s) > 1 for s in self.stages)


# Spread (log-space standard deviation) of the heavy-tailed length distributions. Agent and chat
# workloads are heavy-tailed: most programs are short and a few are very long (ShareGPT turns and
# lengths, tool-loop depths). With memoryless (exponential) sizes no size-blind policy could beat
# FCFS on average; with heavy tails, serving the least-served first pays.
CALLS_SIGMA = 1.2
LENGTH_SIGMA = 0.8


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    """A log-normal sample with the given mean."""
    mu = math.log(max(mean, 1e-9)) - sigma * sigma / 2
    return rng.lognormvariate(mu, sigma)


def _exp_len(rng: random.Random, mean: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(_lognormal(rng, mean, LENGTH_SIGMA)))) if mean > 0 else lo


def _num_calls(rng: random.Random, mean: float, cap: int) -> int:
    """Calls per program, at least 1, heavy-tailed with the given mean (before the cap)."""
    return max(1, min(cap, round(_lognormal(rng, mean, CALLS_SIGMA))))


def call_kind(spec: CallSpec, stage_width: int) -> str:
    """What part of its program's graph a call is: ``join`` (it waits on several threads: a reduce),
    ``parallel`` (one of a fan-out: a map, a tree search's expansion) or ``chain`` (the next call of one thread).
    The simulator reports latency per kind: a policy can favour one at the cost of another."""
    if len(spec.parents) > 1:
        return "join"
    return "parallel" if stage_width > 1 else "chain"


def compaction(length: int, system_len: int, room: int) -> tuple[int, int] | None:
    """How a program shortens a conversation of ``length`` tokens that no longer fits in ``room``.

    ``system_len``: how many of its first tokens are the system prompt (0 once an earlier
    compaction dropped it). None when it fits. Else ``(head, total)``: keep the first ``head``
    tokens (the system prompt, when it fits in half the room) and the newest ``total - head``,
    ``total`` being half the room. Agents compact like this, not by sliding a window every call:
    later calls then extend a stable prefix, which the prefix cache can serve, until the next one.
    """
    if length <= room:
        return None
    total = max(1, room // 2)
    head = system_len if system_len < total else 0
    return head, total


class PromptTokens:
    """The token ids of a run's prompts, all from its seed.

    Every program starts with :data:`SHARED_SYSTEM_PROMPT` tokens it shares with the others (prefix-cache
    hits across programs), then a system prompt of its own; its calls' new inputs follow, drawn in call
    order from a generator of the run's seed and the program id. The benchmark and the simulator draw
    them here, so that for the same programs they send the same prompts.
    """

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.seed = seed
        self.shared = self.draw(random.Random(seed), SHARED_SYSTEM_PROMPT)

    def draw(self, rng: random.Random, n: int) -> list[int]:
        """``n`` token ids, above the low ids where tokenizers keep their special tokens: those
        ``[rng.randrange(100, vocab) for _ in range(n)]`` gives, from the generator's 32-bit words taken in batches
        (``randrange`` keeps a word's top bits when they fall in the range and draws the next word when not; one
        word at a time, it was most of a simulated call's submission)."""
        width = self.vocab - 100
        shift = 32 - width.bit_length()
        out: list[int] = []
        while len(out) < n:
            need = n - len(out)
            # getrandbits fills a wide number from its least significant word up, in the order it draws them.
            words = array("I", rng.getrandbits(32 * need).to_bytes(4 * need, "little"))
            if sys.byteorder == "big":
                words.byteswap()
            out += [100 + r for w in words if (r := w >> shift) < width]
        return out

    def start(self, spec: ProgramSpec) -> tuple[random.Random, list[int]]:
        """A program's generator (for its calls' new inputs) and its whole system prompt."""
        rng = random.Random(f"{self.seed}:{spec.program_id}")
        return rng, self.shared + self.draw(rng, spec.system_prompt)


def call_prompt(
    call: CallSpec,
    system: list[int],
    contexts: dict[str, list[int]],
    outputs: dict[str, list[int]],
    new_input: list[int],
    max_model_len: int,
) -> list[int]:
    """The prompt a program sends for ``call``: the conversation of its first parent (or the system prompt),
    the outputs of its other parents, then its new input; compacted (:func:`compaction`) when that would
    leave too little room for the call's output in ``max_model_len``.

    ``contexts`` maps a thread to its conversation so far (its last prompt and output), ``outputs`` to
    its last output. The one place a call's prompt is built, for the benchmark and the simulator alike.
    """
    base = contexts.get(call.parents[0], system) if call.parents else system
    joined = [t for p in call.parents[1:] for t in outputs.get(p, [])]
    prompt = [*base, *joined, *new_input]  # (one list made, not two)
    room = max_model_len - call.output - 1
    if len(prompt) <= room:
        return prompt  # (as compaction says; without comparing the system prompt, once per call)
    has_system = prompt[: len(system)] == system
    cut = compaction(len(prompt), len(system) if has_system else 0, room)
    if cut is not None:
        head, total = cut
        prompt = prompt[:head] + prompt[len(prompt) - (total - head) :]
    return prompt


@dataclass(frozen=True)
class WorkloadShape:
    scale: float = 0.1  # multiplies token lengths
    call_scale: float = 1.0  # multiplies calls per program
    tool_wait_s: float = 0.2  # mean tool / user time between calls
    max_calls: int = 40
    max_len: int = 512


def _single_thread(
    rng: random.Random, pid: str, t: float, stats: tuple[float, float, float], shape: WorkloadShape
) -> ProgramSpec:
    prompt, output, calls = stats
    spec = ProgramSpec(pid, t, system_prompt=_exp_len(rng, 64 * shape.scale * 4, 8, shape.max_len))
    for _ in range(_num_calls(rng, calls * shape.call_scale, shape.max_calls)):
        spec.stages.append(
            [
                CallSpec(
                    "main",
                    ("main",),
                    _exp_len(rng, prompt * shape.scale, 4, shape.max_len),
                    _exp_len(rng, output * shape.scale, 2, shape.max_len),
                    rng.expovariate(1.0 / shape.tool_wait_s) if shape.tool_wait_s > 0 else 0.0,
                )
            ]
        )
    return spec


def _map_reduce(rng: random.Random, pid: str, t: float, shape: WorkloadShape) -> ProgramSpec:
    prompt, output, _ = SHAREGPT
    spec = ProgramSpec(pid, t, system_prompt=_exp_len(rng, 64 * shape.scale * 4, 8, shape.max_len))
    rounds = _num_calls(rng, 2.0 * shape.call_scale, 8)
    previous: tuple[str, ...] = ()
    for r in range(rounds):
        fan = rng.randint(2, 6)
        maps = [
            CallSpec(
                f"r{r}m{i}",
                previous,
                _exp_len(rng, prompt * shape.scale, 4, shape.max_len),
                _exp_len(rng, output * shape.scale / 2, 2, shape.max_len),
            )
            for i in range(fan)
        ]
        spec.stages.append(maps)
        reduce = CallSpec(
            f"r{r}reduce",
            tuple(m.thread_id for m in maps),
            _exp_len(rng, 16 * shape.scale * 4, 4, shape.max_len),
            _exp_len(rng, output * shape.scale, 2, shape.max_len),
            rng.expovariate(1.0 / shape.tool_wait_s) if shape.tool_wait_s > 0 else 0.0,
        )
        spec.stages.append([reduce])
        previous = (reduce.thread_id,)
    return spec


def _mcts(rng: random.Random, pid: str, t: float, shape: WorkloadShape) -> ProgramSpec:
    prompt, output, calls = LATS
    spec = ProgramSpec(pid, t, system_prompt=_exp_len(rng, 64 * shape.scale * 4, 8, shape.max_len))
    branching = rng.randint(2, 4)
    rounds = _num_calls(rng, calls / branching / 8 * shape.call_scale, shape.max_calls // branching + 1)
    selected = ""
    for r in range(rounds):
        stage = [
            CallSpec(
                f"d{r}b{b}",
                (selected,) if selected else (),
                _exp_len(rng, prompt * shape.scale / 2, 4, shape.max_len),
                _exp_len(rng, output * shape.scale, 2, shape.max_len),
                rng.expovariate(1.0 / shape.tool_wait_s) if shape.tool_wait_s > 0 else 0.0,
            )
            for b in range(branching)
        ]
        spec.stages.append(stage)
        selected = rng.choice(stage).thread_id  # the tree search descends into one expansion
    return spec


@dataclass(frozen=True)
class AgentStats:
    """An agent trajectory's mean lengths in tokens: its first context, each turn's append (tool results, a user
    turn) and output, and its number of turns."""

    context: int
    append: int
    output: int
    turns: float


# DualPath's agent traces (arXiv 2602.21548, Table 2) as issue 13 states them: tens of turns, appends of a few
# hundred tokens, contexts of tens of thousands of tokens (16K to start, ~32K after 32 turns of 384 + 128). Our
# summary of the paper does not carry the table's exact figures; these are round numbers inside those ranges.
DUALPATH_AGENT = AgentStats(context=16384, append=384, output=128, turns=32)


def agent_sessions(
    num_sessions: int,
    rate: float,
    seed: int = 0,
    shape: WorkloadShape | None = None,
    stats: AgentStats = DUALPATH_AGENT,
) -> list[ProgramSpec]:
    """``num_sessions`` agent trajectories arriving by a Poisson process at ``rate`` per second (0: all at once;
    the lengths do not depend on the rate).

    Each is one thread whose every turn appends to the whole conversation so far: a long shared context and
    short appends, the agentic case DualPath is about. Lengths shrink by ``shape.scale`` and turns by
    ``shape.call_scale`` (capped at ``shape.max_calls``) to fit a CPU.
    """
    shape = shape or WorkloadShape()
    rng = random.Random(seed)
    sessions = []
    for i in range(num_sessions):
        context = max(8, round(_lognormal(rng, stats.context * shape.scale, LENGTH_SIGMA / 2)))
        spec = ProgramSpec(f"agent-{seed}-{i}", 0.0, system_prompt=context)
        turns = max(1, min(shape.max_calls, round(stats.turns * shape.call_scale)))
        for _ in range(turns):
            append = _exp_len(rng, stats.append * shape.scale, 1, shape.max_len)
            output = _exp_len(rng, stats.output * shape.scale, 2, shape.max_len)
            wait = rng.expovariate(1.0 / shape.tool_wait_s) if shape.tool_wait_s > 0 else 0.0
            spec.stages.append([CallSpec("main", ("main",), append, output, wait)])
        sessions.append(spec)
    return with_arrivals(sessions, rate, seed)


def with_arrivals(programs: list[ProgramSpec], rate: float, seed: int = 0) -> list[ProgramSpec]:
    """The same programs arriving by a Poisson process at ``rate`` per second (0: all at once), drawn apart from
    their lengths: an offline and an online run then serve the very same programs."""
    rng = random.Random(f"arrivals:{seed}")
    t = 0.0
    out = []
    for spec in programs:
        t += rng.expovariate(rate) if rate > 0 else 0.0
        out.append(dataclasses.replace(spec, arrival_s=t))
    return out


def load_agent_sessions(folder: str | Path, chars_per_token: float = 4.0) -> list[list[tuple[int, int, float]]]:
    """mini-SWE-agent sessions: per call (new input tokens, output tokens, seconds since the previous call)."""
    sessions = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        calls = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        calls.sort(key=lambda c: c["timestamp"])
        out = []
        prev_len = 0
        prev_t = calls[0]["timestamp"] if calls else 0
        for c in calls:
            total = round(len(c["input"]) / chars_per_token)
            out.append(
                (
                    max(1, total - prev_len),
                    max(1, round(len(c["output"]) / chars_per_token)),
                    (c["timestamp"] - prev_t) / 1e6,
                )
            )
            prev_len = total + round(len(c["output"]) / chars_per_token)
            prev_t = c["timestamp"]
        sessions.append(out)
    return sessions


def _trace_program(
    rng: random.Random, pid: str, t: float, session: list[tuple[int, int, float]], shape: WorkloadShape
) -> ProgramSpec:
    spec = ProgramSpec(pid, t, system_prompt=8)
    for new_input, output, _gap in session[: shape.max_calls]:
        spec.stages.append(
            [
                CallSpec(
                    "main",
                    ("main",),
                    max(1, min(shape.max_len, round(new_input * shape.scale))),
                    max(2, min(shape.max_len, round(output * shape.scale))),
                    rng.expovariate(1.0 / shape.tool_wait_s) if shape.tool_wait_s > 0 else 0.0,
                )
            ]
        )
    return spec


def make_programs(
    workload: str,
    num_programs: int,
    rate: float,
    seed: int = 0,
    shape: WorkloadShape | None = None,
    trace_folder: str | Path | None = None,
) -> list[ProgramSpec]:
    """``num_programs`` programs of one workload arriving by a Poisson process at ``rate`` per second."""
    shape = shape or WorkloadShape()
    rng = random.Random(seed)
    sessions = load_agent_sessions(trace_folder) if workload == "trace" and trace_folder else []
    if workload == "trace" and not sessions:
        from boundless.config import ConfigError  # (commands say it in one line)

        raise ConfigError("--trace-folder: the trace workload needs mini-SWE-agent sessions (*.jsonl) there")
    programs = []
    t = 0.0
    for i in range(num_programs):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        pid = f"{workload}-{seed}-{i}"
        if workload == "chat":
            programs.append(_single_thread(rng, pid, t, SHAREGPT, shape))
        elif workload == "react":
            programs.append(_single_thread(rng, pid, t, BFCL, shape))
        elif workload == "mapreduce":
            programs.append(_map_reduce(rng, pid, t, shape))
        elif workload == "mcts":
            programs.append(_mcts(rng, pid, t, shape))
        elif workload == "trace":
            programs.append(_trace_program(rng, pid, t, sessions[i % len(sessions)], shape))
        else:
            raise ValueError(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")
    return programs
