"""The executor face: a typed step result, the `Pipelined` protocol checked by `isinstance`, and
one road from a `Layout` to an executor."""

import pytest
import torch
from _serving_doubles import HistoryExecutor, PipelineHistoryExecutor
from tp_support import tiny_config, write_random_model

from tandem.cli.layout_args import generate_layout
from tandem.cli.main import build_parser
from tandem.cli.pp_options import describe_stages
from tandem.engine.build import Layout, LayoutUnavailable, Limits, build_executor
from tandem.engine.executor import Pipelined, Step, StepResult, StepResultError, StepSequence
from tandem.engine.local import LocalExecutor
from tandem.engine.pp.layout import plan_stages
from tandem.engine.sampling_params import SamplingParams, make_generator
from tandem.loaders.load import load_model
from tandem.loaders.safetensors_dir import ModelDir


def test_a_step_result_holds_exactly_one_of_logits_and_ids() -> None:
    with pytest.raises(StepResultError):
        StepResult()
    with pytest.raises(StepResultError):
        StepResult(logits=torch.zeros(1, 4), token_ids=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(StepResultError):
        StepResult(token_ids=torch.zeros(2))  # float ids
    with pytest.raises(StepResultError):
        StepResult(logits=torch.zeros(4))  # not (B, vocab)


def test_a_step_result_picks_the_chosen_id_or_samples_the_logits() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 1.0]])
    g = make_generator(0)
    greedy = SamplingParams(temperature=0.0)
    by_logits = StepResult(logits=logits)
    by_ids = StepResult(token_ids=torch.tensor([1, 0]))
    assert [by_logits.pick(r, greedy, g) for r in range(2)] == [1, 0]
    assert [by_ids.pick(r, greedy, g) for r in range(2)] == [1, 0]
    assert by_logits.ids().tolist() == by_ids.ids().tolist() == [1, 0]
    assert len(by_logits) == len(by_ids) == 2


def test_a_pipeline_is_recognized_by_isinstance_not_by_its_attributes() -> None:
    assert isinstance(PipelineHistoryExecutor(num_stages=2), Pipelined)
    assert not isinstance(HistoryExecutor(), Pipelined)


def test_a_layout_refuses_per_rank_lists_of_the_wrong_length() -> None:
    with pytest.raises(LayoutUnavailable, match="one per rank"):
        Layout(stage_tp=(2, 1), dtypes=(torch.float32, torch.bfloat16))
    with pytest.raises(LayoutUnavailable, match="at least 1 rank"):
        Layout(stage_tp=(2, 0))
    lay = Layout(stage_tp=(2, 1), devices=("cpu",))
    assert (lay.world_size, lay.tp, lay.pp) == (3, 2, 2)
    assert lay.dtype_names() == ["float32"] * 3


@pytest.mark.parametrize("stage_tp,attn", [((2,), 3), ((2,), 0), ((2, 1), 1)])
def test_a_layout_refuses_attention_ranks_outside_a_one_stage_group(stage_tp, attn) -> None:
    with pytest.raises(LayoutUnavailable, match="--attn-ranks"):
        Layout(stage_tp=stage_tp, attn_ranks=attn)


def test_generate_flags_parse_into_one_layout() -> None:
    parse = build_parser().parse_args
    tp = generate_layout(parse(["generate", "--tp", "2", "--dtype", "bfloat16,float16"]), False)
    assert tp.stage_tp == (2,) and tp.dtypes == (torch.bfloat16, torch.float16)
    pp = generate_layout(parse(["generate", "--layout", "2,1", "--dtype", "float32"]), False)
    assert pp.stage_tp == (2, 1) and pp.dtype_names() == ["float32"] * 3
    # one dtype per rank of a grid, in rank order: the TP stage's two ranks differ
    mixed = ["generate", "--layout", "2,1", "--dtype", "bfloat16,float16,float16"]
    grid = generate_layout(parse(mixed), False)
    assert grid.dtype_names() == ["bfloat16", "float16", "float16"]
    stages = plan_stages(tiny_config(), grid.stage_tp, dtype=",".join(grid.dtype_names()))
    assert [s["rank_dtypes"] for s in describe_stages(stages)] == [
        ["bfloat16", "float16"],
        ["float16"],
    ]
    gguf = generate_layout(parse(["generate"]), True)
    assert gguf.stage_tp == (1,) and gguf.dtypes == (torch.float32,)


def test_build_executor_on_one_device_equals_the_local_executor(tmp_path) -> None:
    d = write_random_model(tmp_path / "m", tiny_config())
    ex = build_executor(d, Layout(), Limits(max_batch=2, max_seq_len=32))
    ref = LocalExecutor(load_model(ModelDir(d)), max_batch=2, max_seq_len=32)
    assert isinstance(ex, LocalExecutor) and ex.health() == (True, "ok") and ex.stats() == {}
    step = Step((StepSequence(0, (1, 2, 3), 0), StepSequence(1, (4,), 0)))
    torch.testing.assert_close(ex.run(step).logits, ref.run(step).logits, rtol=0, atol=0)


@pytest.mark.parametrize("flags", [[], ["--tp", "2"], ["--tp", "3"], ["--layout", "2,1"]])
def test_dtype_auto_on_a_gguf_file_is_float32_on_every_layout(monkeypatch, flags) -> None:
    """A GGUF file's weights dequantize exactly and float32 keeps them so: `--dtype auto` picks it
    for a TP group as for one rank (a TP group once took the device's 16-bit dtype, and `--tp 2`
    decoded other greedy ids than `--tp 1`). The device is made to prefer bfloat16 so the check
    holds on any CPU."""
    import tandem.devices as devices

    monkeypatch.setattr(devices, "auto_dtype", lambda device: torch.bfloat16)
    parse = build_parser().parse_args
    lay = generate_layout(parse(["generate", *flags]), True)
    assert set(lay.dtypes) == {torch.float32}
    # a checkpoint that is not a GGUF file still takes the device's choice, on every layout
    assert set(generate_layout(parse(["generate", *flags]), False).dtypes) == {torch.bfloat16}
