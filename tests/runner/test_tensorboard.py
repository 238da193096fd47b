"""TensorBoard and wandb (``runner/tensorboard.py``): the event file holds the text log's numbers.

- The training entry under ``torch.distributed.run`` on 2 CPU ranks with ``--tensorboard-dir``: the
  event file, read back with TensorBoard's own ``EventAccumulator``, holds every iteration's lm loss
  (the summary line's first and final losses; the log line's interval mean lies between its
  iterations'), the log lines' learning rate, grad norm and microbatch counts, and ODC's scalars with
  plausible values; rank 0 alone writes.
- The writer alone on hand-made figures: ``--tensorboard-log-interval`` picks the iterations; wandb
  (a recording module in its place: the package is not a dependency) gets the same tags.
- A missing package is refused before training, in one line naming the flag and the ``pip install``.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from megatron_odc.runner.arguments import build_parser, validate_args
from megatron_odc.runner.log import LogInterval
from megatron_odc.runner.tensorboard import ODC_TELEMETRY_TAGS, MetricsWriter
from tests.runner.test_trainer import ITERATION_LINE, SUMMARY_LINE, _torchrun

TINY = [
    "--num-layers", "1", "--hidden-size", "32", "--seq-length", "64",
    "--global-batch-size", "8", "--synthetic-num-samples", "64",
]  # fmt: skip


def _scalars(logdir) -> dict[str, dict[int, float]]:
    """Tag -> {step: value} of the event files under ``logdir``, read as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_event_file_holds_the_text_logs_numbers(tmp_path, shm_dir):
    logdir = tmp_path / "tb"
    argv = [*TINY, "--train-iters", "4", "--log-interval", "2", "--tensorboard-dir", str(logdir)]
    stdout = _torchrun(argv, tmp_path, shm_dir)
    lines = {int(m[0]): m for m in ITERATION_LINE.findall(stdout)}
    assert sorted(lines) == [2, 4], stdout[-3000:]
    first, final = (float(x) for x in SUMMARY_LINE.search(stdout).groups())
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1, "only rank 0 writes"
    scalars = _scalars(logdir)

    # Per iteration (--tensorboard-log-interval 1): every lm loss, against iterations and samples.
    loss = scalars["lm loss"]
    assert sorted(loss) == [1, 2, 3, 4]
    assert sorted(scalars["lm loss vs samples"]) == [8, 16, 24, 32]
    assert (loss[1], loss[4]) == pytest.approx((first, final), rel=1e-6)
    for it, line in lines.items():
        # The line's loss is the interval's token-weighted mean: between its iterations' losses.
        interval_loss = float(line[4])
        low, high = sorted((loss[it - 1], loss[it]))
        assert low * (1 - 1e-6) <= interval_loss <= high * (1 + 1e-6), (it, interval_loss, loss)
        assert scalars["learning-rate"][it] == pytest.approx(float(line[3]), rel=1e-6)
        assert scalars["grad-norm"][it] == pytest.approx(float(line[5]), abs=6e-4)
        assert scalars["batch-size"][it] == 8
    assert all(math.isfinite(v) and v > 0 for v in scalars["grad-norm"].values())

    # Per log line: the interval's figures, ODC's under odc/.
    for it, line in lines.items():
        low, high = scalars["odc/num-microbatches-min"][it], scalars["odc/num-microbatches-max"][it]
        assert (low, high) == (int(line[6]), int(line[7]))
        assert 0 <= low <= high
        assert high >= 1
        assert scalars["odc/compute-imbalance"][it] >= 1.0
        for kind in ("fetch-wait", "push", "fence"):
            mean, peak = scalars[f"odc/{kind}-ms-mean"][it], scalars[f"odc/{kind}-ms-max"][it]
            assert 0.0 <= mean <= peak * (1 + 1e-6), (kind, mean, peak)
        assert scalars["odc/plan-ahead-ms-max"][it] == pytest.approx(float(line[8]), abs=0.06)
        assert scalars["odc/plan-wait-ms-max"][it] == pytest.approx(float(line[9]), abs=0.06)
        assert scalars["iteration-time"][it] > 0.0
        assert scalars["tokens-per-second"][it] > 0.0


def _figures(iterations=(1, 2, 3, 4)):
    """Hand-made figures of one log interval (no process group: ``pairs`` given directly)."""
    interval = LogInterval()
    for i, it in enumerate(iterations):
        interval.add(
            iteration=it,
            elapsed_s=0.5,
            num_tokens=100 + i,
            microbatch_counts=[i % 2, 2],
            pair=torch.tensor([10.0 + i, 4.0 + i], dtype=torch.float64),
            grad_norm=1.0 + i,
            learning_rate=1e-3 * (i + 1),
            update_successful=True,
        )
    telemetry = {key: 0.25 + n for n, (key, _) in enumerate(ODC_TELEMETRY_TAGS.values())}
    pairs = torch.stack(interval.pairs)
    return interval.figures(pairs=pairs, global_batch_size=8, telemetry=telemetry, eta_s=0.0)


def test_tensorboard_log_interval_picks_the_iterations(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    figures = _figures()
    writer = MetricsWriter(SummaryWriter(str(tmp_path)), None, tensorboard_log_interval=2)
    writer.write(figures)
    writer.close()
    scalars = _scalars(tmp_path)
    per_iteration = {f.iteration: f for f in figures.per_iteration}
    assert scalars["lm loss"] == pytest.approx({2: 11.0 / 5.0, 4: 13.0 / 7.0})
    assert scalars["learning-rate"] == pytest.approx({2: 2e-3, 4: 4e-3})
    assert scalars["grad-norm vs samples"] == pytest.approx({16: 2.0, 32: 4.0})
    assert {it: per_iteration[it].lm_loss for it in (2, 4)} == pytest.approx(scalars["lm loss"])
    # The interval's figures at its last iteration: counts over every rank and iteration.
    assert scalars["odc/num-microbatches-min"] == {4: 0.0}
    assert scalars["odc/num-microbatches-max"] == {4: 2.0}
    assert scalars["odc/fence-ms-max"] == pytest.approx(
        {4: 1000 * figures.telemetry["fence_s_max"]}
    )
    assert scalars["iteration-time"] == pytest.approx({4: 0.5})


def _validated(argv: list[str]):
    return validate_args(build_parser().parse_args(argv), world_size=2)


def test_wandb_gets_the_same_tags(tmp_path, monkeypatch):
    calls: list[tuple[str, object]] = []
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kwargs: calls.append(("init", kwargs))
    wandb.log = lambda data, step: calls.append(("log", (step, data)))
    wandb.finish = lambda: calls.append(("finish", None))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    args = _validated(
        ["--wandb-project", "odc", "--wandb-exp-name", "run1", "--save", str(tmp_path)]
    )
    writer = MetricsWriter.open(args)
    assert writer.tensorboard is None
    writer.write(_figures())
    writer.close()
    kind, init = calls[0]
    assert (kind, init["project"], init["name"]) == ("init", "odc", "run1")
    assert init["dir"] == str(tmp_path / "wandb")  # Megatron-LM's default: SAVE/wandb
    assert calls[-1] == ("finish", None)
    logged = {(step, tag) for kind, (step, data) in calls[1:-1] for tag in data}
    assert (3, "lm loss") in logged
    assert (4, "odc/compute-imbalance") in logged
    assert not any(tag.endswith(" vs samples") for _, tag in logged)


@pytest.mark.parametrize(
    ("module", "argv", "flag", "package"),
    [
        (
            "torch.utils.tensorboard",
            ["--tensorboard-dir", "tb"],
            "--tensorboard-dir",
            "tensorboard",
        ),
        ("wandb", ["--wandb-project", "p", "--wandb-exp-name", "e"], "--wandb-project", "wandb"),
    ],
)
def test_a_missing_package_is_refused_in_one_line(
    module, argv, flag, package, tmp_path, monkeypatch, capsys
):
    from megatron_odc import train

    monkeypatch.setitem(sys.modules, module, None)  # import fails as if it were not installed
    monkeypatch.chdir(tmp_path)
    status = train.main([*argv, "--save", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1, err
    assert flag in err, err
    assert f"pip install {package}" in err, err
    assert not (tmp_path / "runs").exists(), "the data set was generated before the check"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--wandb-exp-name", "e"], "--wandb-exp-name"),
        (["--wandb-save-dir", "d"], "--wandb-save-dir"),
        (["--wandb-project", "p"], "--wandb-exp-name"),
        (["--tensorboard-log-interval", "0"], "--tensorboard-log-interval"),
    ],
)
def test_bad_metrics_flags_are_refused(argv, flag):
    with pytest.raises(ValueError, match=flag):
        _validated(argv)


def test_skipped_steps_and_the_loss_scale_are_recorded(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    interval = LogInterval()
    for it, ok in ((1, False), (2, True), (3, False)):
        interval.add(
            iteration=it,
            elapsed_s=0.5,
            num_tokens=100,
            microbatch_counts=[1, 2],
            pair=torch.tensor([10.0, 4.0], dtype=torch.float64),
            grad_norm=None if not ok else 1.0,
            learning_rate=1e-3,
            update_successful=ok,
        )
    pairs = torch.stack(interval.pairs)
    figures = interval.figures(
        pairs=pairs, global_batch_size=8, telemetry=None, eta_s=0.0, loss_scale=1024.0
    )
    assert "number of skipped iterations:   2 | loss scale: 1024.0" in figures.line(10)
    writer = MetricsWriter(SummaryWriter(str(tmp_path)), None, tensorboard_log_interval=1)
    writer.write(figures)
    writer.close()
    scalars = _scalars(tmp_path)
    assert scalars["skipped-iterations"] == {3: 2.0}
    assert scalars["loss-scale"] == {3: 1024.0}
    assert "(every step of the interval)" not in figures.line(10)
