"""train_and_evaluate: the training loop, as small functions.

    config -> Input (tokenizer, batches) -> model -> TrainState
    -> [restore latest | init_from] -> steps (jit) -> log / eval / checkpoint
    -> final checkpoint -> decode held-out examples -> metric
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import math
import signal
import tempfile
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from transformer_zoo.configs import schema
from transformer_zoo.train import inspect, parallel, plots, predict, stages, workdir_lock
from transformer_zoo.train.checkpoint import (
    Checkpointer,
    average_checkpoints,
    checkpoint_dir,
    write_json,
)
from transformer_zoo.train.cli import brief
from transformer_zoo.train.input import Input, build_input, copy_tokenizer
from transformer_zoo.train.losses import summarize
from transformer_zoo.train.metrics import CompileTimer, MetricWriter, Progress
from transformer_zoo.train.scores import DecodeMetric
from transformer_zoo.train.state import TrainState, create_train_state, make_optimizer
from transformer_zoo.train.step import make_eval_step, make_train_step
from transformer_zoo.train.tasks import Family, Task, get_task, model_config_from

log = logging.getLogger("train")


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf; the last good checkpoint is kept."""


@dataclasses.dataclass
class Run:
    """The objects a run is made of (also what tests and decoding reuse)."""

    config: Any
    workdir: Path
    input: Input
    model: nn.Module
    model_config: Any
    state: TrainState
    schedule: Any
    checkpointer: Checkpointer
    plan: parallel.Plan
    state_shardings: TrainState
    task: Task  # the model family's (train/tasks.py), chosen once from config.family


def model_config_dict(model_config) -> dict:
    """The model config as saved: `kernels` is left out, as it says how this run's
    devices compute, not what the model is (a restore picks its own)."""
    out = dataclasses.asdict(model_config)
    out["dtype"], out["param_dtype"] = str(out["dtype"]), str(out["param_dtype"])
    out.pop("kernels")
    return {k: str(v) if isinstance(v, enum.Enum) else v for k, v in out.items()}


def saved_config(run: Run) -> dict:
    """The JSON stored with every checkpoint: run config + resolved model config."""
    return {"run": run.config.to_dict(), "model": model_config_dict(run.model_config),
            "family": run.config.family}


def init_params(model, task: Task | Family | str, seed: int):
    """Unboxed parameters of `model` (logical axis names are in the boxed init)."""
    batch = get_task(task).dummy_batch()
    variables = jax.jit(lambda k: model.init(k, **batch))(jax.random.key(seed))
    return nn.meta.unbox(variables["params"])


def init_state(model, task: Task | Family | str, tx, seed: int, plan: parallel.Plan):
    """(fresh TrainState created directly in its shardings, the shardings).

    Values equal init_params + create_train_state on one device (threefry is
    partitionable, so a sharded init draws the same numbers).
    """
    task = get_task(task)

    def make():
        params = nn.meta.unbox(model.init(jax.random.key(seed), **task.dummy_batch())["params"])
        return create_train_state(params, tx, seed)

    shardings = plan.shardings(model, task, jax.eval_shape(make))
    return jax.jit(make, out_shardings=shardings)(), shardings


def setup(config, workdir) -> Run:
    """Builds input, model, optimizer, fresh state and checkpointer."""
    schema.check(config)  # a misspelt key or bad value fails before anything is done
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if config.init_from:
        _adopt_tokenizer(Path(config.init_from), workdir)
    inp = build_input(config, workdir)
    plan = parallel.Plan.from_config(config.parallel)
    ids = {name: getattr(inp.tokenizer, name) for name in ("pad_id", "bos_id", "eos_id")}
    model_config = model_config_from(config.model, inp.tokenizer.vocab_size,
                                     kernels=plan.kernels, special_ids=ids,
                                     output_ids=inp.output_ids)
    task = get_task(config.family)
    model = task.build(model_config)
    tx, schedule = make_optimizer(config.optim, model_config.d_model, config.train.num_steps)
    state, shardings = init_state(model, task, tx, config.seed, plan)
    ckpt = Checkpointer(workdir, keep=config.train.keep_checkpoints,
                        best_metric=config.train.best_metric or None,
                        best_mode=config.train.best_mode)
    return Run(config, workdir, inp, model, model_config, state, schedule, ckpt, plan,
               shardings, task)


def _adopt_tokenizer(source: Path, workdir: Path) -> None:
    """Fine-tuning starts from init_from's tokenizer (a converted checkpoint's
    own): copied into a workdir that has none yet, where the data tasks find it."""
    if jax.process_index() == 0:
        copy_tokenizer(source, workdir)
    multihost_utils.sync_global_devices("init_from tokenizer copied")


def _check_same_model(source: Checkpointer, step: int, run: Run) -> None:
    """ValueError naming the model fields in which init_from's model and this run's differ."""
    theirs = source.restore_config(step).get("model", {})
    ours = model_config_dict(run.model_config)
    differ = {k: (theirs[k], ours[k]) for k in sorted(set(theirs) & set(ours))
              if k not in schema.FINE_TUNABLE_MODEL_FIELDS and theirs[k] != ours[k]}
    if differ:
        raise ValueError(f"init_from={run.config.init_from!r} holds another model: "
                         + ", ".join(f"model.{k} is {brief(a)!r} there, {brief(b)!r} here"
                                     for k, (a, b) in differ.items()))


def restore_or_start(run: Run) -> tuple[TrainState, dict | None]:
    """Resumes from the newest intact checkpoint, else starts (optionally from init_from).

    Damaged newer steps are logged and moved aside to <step>.damaged (see
    Checkpointer.restore_latest_intact); a workdir whose steps are all damaged
    is a ValueError naming it.
    """
    found = run.checkpointer.restore_latest_intact(run.state)
    if found is not None:
        latest, state, data_state = found
        log.info("resumed from %s step %d", run.checkpointer.directory, latest)
        return state, data_state
    if run.config.init_from:
        source = Checkpointer(run.config.init_from, read_only=True, async_save=False)
        step = source.latest_step()
        if step is None:
            raise ValueError(f"init_from={run.config.init_from!r} holds no checkpoint")
        _check_same_model(source, step, run)
        params = source.restore_params(step, run.state.params)
        log.info("initialised params from %s step %d", run.config.init_from, step)
        return run.state.replace(params=params), None
    return run.state, None


class StopSignal:
    """SIGTERM / Ctrl-C set a flag; the loop checkpoints and exits at a step boundary."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        log.warning("signal %d: saving a checkpoint and stopping", signum)
        self.requested = True

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def evaluate(run: Run, eval_step, params, batches=None) -> dict[str, float]:
    """Held-out loss, accuracy and perplexity (over every process's eval shard).

    `batches` defaults to a fresh pass over run.input.eval_batches().
    """
    sums = None
    batches = run.input.eval_batches() if batches is None else batches
    for batch in _eval_batches(batches):
        out = jax.device_get(eval_step(params, batch))
        sums = out if sums is None else jax.tree.map(np.add, sums, out)
    if sums is None:
        return {}
    return summarize(sums, run.config.train.label_smoothing, run.model_config.output_size)


def _eval_batches(batches):
    """The eval batches; across processes, padded with empty ones to equal counts.

    The eval step is a collective, so every process must call it equally often
    with equal shapes (eval batches have one shape per run when multi-process).
    Empty batches (all padding) add nothing to the sums.
    """
    if jax.process_count() == 1:
        yield from batches
        return
    batches = list(batches)
    most = int(np.max(multihost_utils.process_allgather(np.int32(len(batches)))))
    if most and not batches:
        raise ValueError(f"process {jax.process_index()} has no eval batches while others "
                         f"have {most}; use fewer processes or more eval examples")
    yield from batches
    for _ in range(most - len(batches)):
        yield jax.tree.map(np.zeros_like, batches[0])


def final_scores(run: Run, params) -> dict[str, float]:
    """End-of-run metrics: held-out decoding, checkpoint averaging, test decoding.

    With train.average_last = N > 1, the last N checkpoints are averaged into
    WORKDIR/averaged (reused if present); the held-out set is decoded with the
    final and the averaged params and the better one (held-out only, never the
    test set) decodes data.test_source, if the recipe has one.
    """
    result = predict.score_examples(run, params)
    if run.input.long_eval_batches is not None:
        result.update(_long_context_scores(run, params))
    if run.task.family == Family.DECODER_ONLY and run.config.decode.sample_length:
        _print_sample(run, params)
    n = run.config.train.average_last
    if n > 1 and result:
        averaged = _averaged_params(run, n)
        if averaged is not None:
            scores = predict.score_examples(run, averaged, tag=f"heldout_avg{n}")
            metric = DecodeMetric(run.config.decode.metric)  # the key of its score
            result.update({f"avg{n}_{k}": v for k, v in scores.items()})
            better = scores[metric] > result[metric]
            result["selected_average"] = float(better)
            params = averaged if better else params
    if run.input.test_examples:
        scores = predict.score_examples(run, params, examples=run.input.test_examples, tag="test")
        result.update({f"test_{k}": v for k, v in scores.items()})
    return result


def _long_context_scores(run: Run, params) -> dict[str, float]:
    """The held-out loss in rows of data.long_eval_length tokens (RoPE/ALiBi beyond training)."""
    step = make_eval_step(run.model, run.task, run.config.train.label_smoothing)
    scores = evaluate(run, run.plan.jit_eval_step(step), params, run.input.long_eval_batches())
    length = run.config.data.long_eval_length
    log.info("held-out loss at context %d: %.4f", length, scores["loss"])
    return {"long_context_length": float(length), "long_context_loss": scores["loss"],
            "long_context_accuracy": scores["accuracy"]}


def _print_sample(run: Run, params) -> None:
    """A sampled continuation of decode.sample_prompt, printed and written to sample.txt."""
    cfg = run.config.decode
    prompt = cfg.sample_prompt
    text = predict.generate_texts(run.model, params, run.input.tokenizer, [prompt],
                                  max_new_tokens=cfg.sample_length,
                                  temperature=cfg.sample_temperature,
                                  seed=run.config.seed)[0]
    print(f"sample ({cfg.sample_length} tokens after {prompt!r}):\n{prompt}{text}")
    if jax.process_index() == 0:
        (run.workdir / "sample.txt").write_text(prompt + text + "\n", "utf-8")


def _averaged_params(run: Run, n: int):
    steps = run.checkpointer.all_steps()
    if len(steps) < n or jax.process_count() > 1:
        log.warning("not averaging: %d checkpoints %s for average_last=%d, %d processes "
                    "(python -m transformer_zoo.train.average does it offline)", len(steps), steps,
                    n, jax.process_count())
        return None
    out = run.workdir / "averaged"
    saved = checkpoint_dir(out)
    if not saved.is_dir() or not any(saved.iterdir()):
        average_checkpoints(run.workdir, out, n, run.state.params)
    copy_tokenizer(run.workdir, out)  # decodable on its own
    source = Checkpointer(out, read_only=True, async_save=False)
    if source.latest_step() != steps[-1]:  # from an earlier, shorter run: never overwritten
        log.warning("not averaging: %s holds an average ending at step %s, not %d; move it "
                    "away to average again", out, source.latest_step(), steps[-1])
        return None
    return source.restore_params(source.latest_step(), run.state.params)


def _check_finite(step: int, metrics) -> None:
    loss = float(metrics["loss"])
    if not math.isfinite(loss):
        raise NonFiniteLossError(f"loss became {loss} at step {step}; stopping. "
                                 "The last good checkpoint is kept.")


@jax.jit
def _params_finite(params) -> jax.Array:
    """True when every parameter is finite and their squared norm does not overflow."""
    total = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(params))
    return jnp.isfinite(total)


def _check_params_finite(step: int, params) -> None:
    """A checkpoint is saved only from finite parameters.

    The loss checked at step k was computed with the parameters before step k's
    update, so it cannot vouch for the ones being saved: those are checked
    here. A sum of squares that overflows float32 (|p| above ~1e19, e.g. after
    a learning rate of 1e30) counts as not finite: no finite loss follows it.
    """
    if not bool(_params_finite(params)):
        raise NonFiniteLossError(f"parameters became non-finite (or overflow float32) at step "
                                 f"{step}; not saving them. The last good checkpoint is kept.")


def command_line_overrides(config) -> dict:
    """The `--config.<field>=<value>` flags given to `python -m transformer_zoo.train`.

    ml_collections records them on its config flag: how this run's config differs
    from its recipe file. They are returned only when `config` is the config those
    flags built; a config passed to train_and_evaluate from Python has no command
    line and gets {}.
    """
    from absl import flags
    from ml_collections import config_flags

    from_flags = ("config" in flags.FLAGS and flags.FLAGS.is_parsed()
                  and flags.FLAGS["config"].value is config)
    return config_flags.get_override_values(flags.FLAGS["config"]) if from_flags else {}


def _output_vocab_line(model_config) -> list[str]:
    if model_config.output_ids is None:
        return []
    return [f"output layer and loss over {model_config.output_size:,} of the "
            f"{model_config.vocab_size:,} ids: the training targets' pieces "
            "(data.output_vocab='target_side')"]


def print_run_header(run: Run, overrides: dict) -> None:
    """Prints, once at the start: devices, mesh, the model summary and the config overrides.

    `overrides` are the command line's (`command_line_overrides`). The model
    summary (models/summary.py) takes the run's row length as L.
    """
    from transformer_zoo.models.summary import DEFAULT_SEQ_LEN, format_summary

    devices, mesh = list(run.plan.mesh.devices.flat), run.plan.mesh
    kinds = ", ".join(sorted({d.device_kind for d in devices}))
    data = run.config.data
    seq_len = next((data[k] for k in ("max_targets_length", "seq_length", "max_inputs_length")
                    if data.get(k)), DEFAULT_SEQ_LEN)
    lines = [f"devices: {len(devices)} x {devices[0].platform} ({kinds}), "
             f"{jax.process_count()} process(es)",
             f"mesh: shape {tuple(mesh.shape.values())} over axes {tuple(mesh.axis_names)}, "
             f"step {run.plan.step}",
             format_summary(run.model_config, run.task.family, seq_len=seq_len,
                            seq_lens=(seq_len,)),
             *_output_vocab_line(run.model_config),
             "",
             "config overrides (command line): "
             + (", ".join(f"{k}={v!r}" for k, v in sorted(overrides.items())) or "none")]
    print("\n".join(lines), flush=True)


def train_and_evaluate(config, workdir) -> dict[str, float]:
    """Trains (resuming if WORKDIR has checkpoints), evaluates, decodes; returns metrics.

    A recipe with a `pre_stage` first trains that in WORKDIR/pre_stage and starts
    from its params (train/stages.py).
    """
    with CompileTimer() as timer:
        train = functools.partial(_train_and_evaluate, overrides=command_line_overrides(config))
        result = stages.run_with_pre_stage(config, workdir, train)
    log.info("compilation (tracing + lowering + XLA): %.1f s in %d programs", timer.seconds,
             timer.compiles)
    return result


def _train_and_evaluate(config, workdir, overrides: dict) -> dict[str, float]:
    parallel.initialize_distributed(config.parallel)  # before anything touches devices
    schema.check(config)  # before the workdir is created or locked
    Path(workdir).mkdir(parents=True, exist_ok=True)
    # One trainer per workdir (a shared one on many hosts: process 0 holds it).
    lock = (workdir_lock.exclusive(workdir) if jax.process_index() == 0
            else contextlib.nullcontext())
    with lock:
        return _locked_train_and_evaluate(config, workdir, overrides)


def _locked_train_and_evaluate(config, workdir, overrides: dict) -> dict[str, float]:
    run = setup(config, workdir)
    state, data_state = restore_or_start(run)  # fails before anything is written
    if jax.process_index() == 0:
        print_run_header(run, overrides)
        write_json(run.workdir / "config.json", saved_config(run))
    train_iter = iter(run.input.train)
    if data_state:
        train_iter.set_state(data_state)
    writer = MetricWriter(run.workdir)
    if int(state.step) == 0:  # once per run: a resumed run's first event file has them
        writer.write_hparams(config.to_dict(), _hparam_metrics(run))
    try:
        state, last_eval = _train(run, state, train_iter, writer)
    except BaseException:
        _close_after_failure(run, writer)
        raise
    run.checkpointer.wait()
    writer.close()
    result = dict(last_eval)
    if int(state.step) >= config.train.num_steps:
        result.update(final_scores(run, state.params))
        writer_final = MetricWriter(run.workdir)
        writer_final.write(int(state.step), "final", result)
        if jax.process_index() == 0:
            write_json(run.workdir / "final_metrics.json", result)
        _write_final_pictures(run, state.params, writer_final, int(state.step))
        writer_final.close()
    return result


def _close_after_failure(run: Run, writer: MetricWriter) -> None:
    """Finishes a save in flight and closes the metric files after the loop failed.

    Their own errors (a full disk fails them too) are logged, not raised, so the
    error that stopped the loop is the one reported.
    """
    for finish in (run.checkpointer.wait, run.checkpointer.close, writer.close):
        try:
            finish()
        except Exception as err:  # noqa: BLE001 (the first failure is being raised)
            log.warning("while stopping: %s", err)


def _train(run: Run, state: TrainState, train_iter, writer: MetricWriter):
    cfg = run.config.train
    plan = run.plan
    step_fn = make_train_step(run.model, run.task, cfg.label_smoothing, run.schedule,
                              axis_name=plan.axis_name, loss_chunks=cfg.loss_chunks)
    train_step = plan.jit_train_step(step_fn, run.state_shardings)
    eval_step = plan.jit_eval_step(make_eval_step(run.model, run.task, cfg.label_smoothing))
    start = int(state.step)
    state = plan.place_state(state)
    progress = Progress(start, cfg.num_steps)
    pending, sums, last_eval = None, None, {}
    with StopSignal() as stop:
        for step in range(start + 1, cfg.num_steps + 1):
            batch = next(train_iter)
            data_state = train_iter.get_state()
            state, metrics = train_step(state, plan.batch(batch))
            run.checkpointer.check_saves()  # a failed background save stops the run now
            if pending is not None:  # checked one step late so the host never waits
                _check_finite(*pending)
            pending = (step, metrics)
            sums = _accumulate(sums, metrics)
            if step % cfg.log_every == 0 or step == cfg.num_steps:
                _check_finite(*pending)
                _log_train(run, writer, progress, step, sums)
                sums = None
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.num_steps):
                params = plan.global_state(state, run.state).params
                last_eval = evaluate(run, eval_step, params)
                if run.config.decode.eval_examples:  # BLEU / exact match on a bounded subset
                    last_eval.update(predict.score_examples(
                        run, params, limit=run.config.decode.eval_examples))
                log.info("eval step %d: %s", step, _fmt(last_eval))
                writer.write(step, "eval", last_eval)
                _write_samples(run, params, writer, step, "eval")
            if step % cfg.checkpoint_every == 0 or step == cfg.num_steps or stop.requested:
                _check_finite(*pending)
                saved = plan.global_state(state, run.state)
                _check_params_finite(step, saved.params)
                evaluated = cfg.eval_every and (step % cfg.eval_every == 0
                                                or step == cfg.num_steps)
                # Ranked by this step's own eval only: a stale one would rank it wrongly.
                run.checkpointer.save(step, saved, data_state, saved_config(run),
                                      metrics=last_eval if evaluated else None)
            if stop.requested:
                log.warning("stopped at step %d after a signal; checkpoint saved", step)
                break
    return plan.global_state(state, run.state), last_eval


def _hparam_metrics(run: Run) -> list[str]:
    """The scalar tags TensorBoard's HParams dashboard shows beside the config."""
    tags = ["eval/loss", "eval/accuracy", "final/loss", "final/accuracy"]
    if run.task.family == Family.ENCODER_DECODER:
        tags.append(f"final/{run.config.decode.metric}")
    return tags


def _text_samples(run: Run, params) -> str | None:
    """Decoded samples as markdown: the first decode.num_print held-out examples
    translated as score_examples does, or decode.sample_prompt continued as
    _print_sample does (sample_length > 0); None when the run has neither."""
    cfg = run.config.decode
    examples = run.input.eval_examples[: cfg.num_print]
    if run.task.family == Family.ENCODER_DECODER and examples:
        hyps = predict.translate_texts(run.model, params, run.input.tokenizer,
                                       [e["inputs"] for e in examples], beam_size=cfg.beam_size,
                                       alpha=cfg.alpha, max_extra=cfg.max_extra,
                                       batch_size=cfg.batch_size)
        cell = lambda text: text.replace("|", "\\|")
        rows = [f"| {cell(e['inputs'])} | {cell(h)} | {cell(e['targets'])} |"
                for e, h in zip(examples, hyps, strict=True)]
        return "\n".join(["| source | output | reference |", "|---|---|---|", *rows])
    if run.task.family == Family.DECODER_ONLY and cfg.sample_length:
        text = predict.generate_texts(run.model, params, run.input.tokenizer, [cfg.sample_prompt],
                                      max_new_tokens=cfg.sample_length,
                                      temperature=cfg.sample_temperature, seed=run.config.seed)[0]
        # Indented: a markdown code block keeps the sample's newlines and spaces.
        return "\n".join("    " + line for line in (cfg.sample_prompt + text).split("\n"))
    return None


def _write_samples(run: Run, params, writer: MetricWriter, step: int, split: str) -> None:
    """The decoded samples as TensorBoard text SPLIT/samples (decoded on every process)."""
    samples = _text_samples(run, params)
    if samples:
        writer.write_text(step, f"{split}/samples", samples)


def _write_final_pictures(run: Run, params, writer: MetricWriter, step: int) -> None:
    """The end of a run for TensorBoard: decoded samples, the attention maps of the first
    held-out example (teacher-forced on its reference; single-process runs), and the
    training curves, also written to WORKDIR/curves.png (process 0)."""
    _write_samples(run, params, writer, step, "final")
    if jax.process_index() != 0:
        return
    if run.input.eval_examples and jax.process_count() == 1:
        example = run.input.eval_examples[0]
        target = example["targets"] if run.task.family == Family.ENCODER_DECODER else None
        try:
            seen = inspect.inspect_text(run.model, params, run.input.tokenizer,
                                        run.task.family, example["inputs"], target)
        except ValueError as err:  # an example beyond the position table: no pictures
            log.warning("no attention images: %s", err)
        else:
            with tempfile.TemporaryDirectory() as folder:
                for path in inspect.write_attention(seen, folder):
                    writer.write_image(step, f"final/{path.stem}", path)
    curves = plots.training_curves(run.workdir / "metrics.jsonl", run.workdir / "curves.png")
    writer.write_image(step, "final/curves", curves)


def _accumulate(sums, metrics):
    keys = ("loss_sum", "nll_sum", "correct_sum", "tokens")
    part = {k: metrics[k] for k in keys}
    part["learning_rate"] = metrics.get("learning_rate", jnp.zeros(()))
    part["steps"] = jnp.ones(())
    return part if sums is None else jax.tree.map(jnp.add, sums, part)


def _log_train(run, writer, progress, step, sums):
    sums = jax.device_get(sums)
    scalars = summarize(sums, run.config.train.label_smoothing, run.model_config.output_size)
    scalars["learning_rate"] = float(sums["learning_rate"]) / float(sums["steps"])
    line = progress.line(step, scalars["loss"], scalars["learning_rate"], float(sums["tokens"]))
    log.info("%s", line)
    scalars["tokens_per_step"] = float(sums["tokens"]) / float(sums["steps"])
    writer.write(step, "train", scalars)


def _fmt(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
