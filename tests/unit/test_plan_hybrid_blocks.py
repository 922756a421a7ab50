"""`tandem plan --model FILE` plans a hybrid's TP split with the file's block sizes, so it offers
exactly the TP degrees the loader (`parallel.plan.plan_for_source`) takes and refuses the ones
the loader refuses with `DegeneratePlanError`.

The file: tiny-qwen35 with 4 q/k heads serving 8 tiled v heads of 16, in Q8_0. Its DeltaNet
out_proj contracts in blocks of 32 = two v heads, so the q/k heads go in units of two
(`TPPlan.linear_align`): TP=2 plans, TP=3 and TP=4 leave a rank without a unit. Planned from the
config alone (no blocks) every degree up to 4 would pass.
"""

import json
from dataclasses import replace

from tandem.cli.main import build_parser
from tandem.loaders.gguf.writer import write_model_dir_gguf
from tandem.loaders.make import make_model_dir
from tandem.loaders.source import open_model
from tandem.models.presets import get_preset
from tandem.parallel.plan import TPPlanError, plan_for_config, plan_for_source

DEGREES = (1, 2, 3, 4)


def _plannable(plan, *args) -> set[int]:
    out = set()
    for tp in DEGREES:
        try:
            plan(*args, tp)
        except TPPlanError:
            continue
        out.add(tp)
    return out


def test_tandem_plan_offers_exactly_the_tp_degrees_the_loader_takes(tmp_path, capsys) -> None:
    c = get_preset("tiny-qwen35").config
    net = replace(c.deltanet, num_key_heads=4, num_value_heads=8, value_head_dim=16)
    make_model_dir(tmp_path / "m", "tiny-qwen35", seed=0, config=replace(c, deltanet=net))
    path = write_model_dir_gguf(tmp_path / "m", tmp_path / "m.gguf", "Q8_0")[0]
    source = open_model(path)
    loader = _plannable(plan_for_source, source)
    assert loader == {1, 2}
    assert _plannable(plan_for_config, source.config) == set(
        DEGREES
    )  # what the file's blocks forbid

    nodes = [arg for i in range(len(DEGREES)) for arg in ("--node", f"n{i}:10ms")]
    args = build_parser().parse_args(
        ["plan", "--model", str(path), *nodes, "--max-pp", "1", "--json"]
    )
    assert args.func(args) == 0
    layouts = [p["layout"] for p in json.loads(capsys.readouterr().out)["predictions"]]
    planned = {1 if name == "single" else int(name.removeprefix("TP=")) for name in layouts}
    assert planned == loader
