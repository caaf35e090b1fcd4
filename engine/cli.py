"""kvfleet-engine: generate text from the command line, or serve the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from pydantic import ValidationError

# Nothing heavy is imported here (no torch, aiohttp or the engine): --help, a mistyped flag and
# a model path that is not there are answered at once; each command imports what it runs.
from kvfleet.engine.checkpoint_path import find_checkpoint
from kvfleet.engine.engine_args import EngineArgs
from kvfleet.engine.server.settings import ServerSettings, resolve_api_key
from kvfleet.protocol.unused_packages import keep_out_unused_packages
from kvfleet.telemetry.logs import add_log_flags, configure_logging
from kvfleet.telemetry.settings_flags import DEFAULT, add_model_flags, flag_values, one_line
from kvfleet.telemetry.tracing import TracingUnavailable, add_tracing_flag, tracing_from

logger = logging.getLogger("kvfleet.engine")

# A start-up error (a bad setting, a model that is not there, a port in use) exits 2, as
# argparse's usage errors do; Ctrl-C exits 130, as a shell reports a process SIGINT ended.
EXIT_START_ERROR = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser, EngineArgs, "engine")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The engine's arguments from the flags, the model fetched if it is the default one, and
    its path checked: a path that names no model is said before the engine is imported."""
    values = flag_values(ns, EngineArgs)
    if values["model"] is None:
        from kvfleet.engine.default_model import default_model_path

        values["model"] = str(default_model_path())
    args = EngineArgs(**values)
    find_checkpoint(args.model)
    return args


def _generate(ns: argparse.Namespace) -> int:
    args = engine_args_from(ns)
    from kvfleet.engine.llm import LLM
    from kvfleet.engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.sampling_seed,
        n=ns.n,
    )
    llm = LLM(**args.model_dump())
    for prompt, out in zip(ns.prompt, llm.generate(ns.prompt, params), strict=True):
        for choice in out.outputs:
            sys.stdout.write(
                f"prompt: {prompt!r}\n"
                f"output[{choice.index}]: {choice.text!r}\n"
                f"  tokens={len(choice.token_ids)} finish_reason={choice.finish_reason} "
                f"cached_prompt_tokens={out.num_cached_tokens}\n"
            )
    return 0


def _serve(ns: argparse.Namespace) -> int:
    import asyncio

    settings = server_settings_from(ns)
    args = engine_args_from(ns)
    from kvfleet.engine.server.app import serve

    # Before the model loads: a missing SDK or a bad endpoint is said at once.
    tracing = tracing_from(ns.otlp_traces_endpoint, "engine")
    runner = asyncio.Runner()
    try:
        code = runner.run(serve(args, settings, tracing))
    except BaseException:
        runner.close()
        raise
    finally:
        if tracing is not None:
            tracing.shutdown()
    if code != 0:
        # app.EXIT_ENGINE_STUCK, or a signal cut the model's load or the drain short: a thread is
        # still inside a torch op (the load, a step). Closing the loop would wait for its
        # threads, and the interpreter's finalization would end them with pthread_exit when
        # the op returns, an unwind through torch's C++ frames that aborts the process
        # (SIGABRT, "terminate called without an active exception").
        exit_without_finalizing(code)
    runner.close()
    return code


def exit_without_finalizing(code: int) -> NoReturn:
    """Exit now, the logs flushed, leaving the process's threads as they are. Its
    multiprocessing children (tensor-parallel workers) are ended as a normal exit ends them."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def server_settings_from(ns: argparse.Namespace) -> ServerSettings:
    """The server's settings from `serve` flags, the API key resolved (flag, file, environment)
    so that a missing or empty key file fails at startup; the default model is served under its
    short name rather than its cache path."""
    settings = ServerSettings(**flag_values(ns, ServerSettings))
    settings.api_key = resolve_api_key(settings)
    if settings.served_model_name is None and ns.model is None:
        from kvfleet.engine.default_model import DEFAULT_MODEL_NAME

        settings.served_model_name = [DEFAULT_MODEL_NAME]
    return settings


# What the engine image's entrypoint (`kvfleet-engine serve`) receives from `docker run IMAGE
# kvfleet-engine serve ...`, the form that worked before the image had one.
_COMMAND_WORDS = frozenset({"kvfleet-engine", "serve", "generate"})


def _command_as_model(word: str) -> str:
    return (
        f"MODEL {word!r} is a command, not a model: in the engine image, whose entrypoint is "
        "already `kvfleet-engine serve`, give serve's arguments alone (docker run IMAGE [MODEL] "
        "[flags]); another command: docker run --entrypoint kvfleet-engine IMAGE generate ..."
    )


class FlagParser(argparse.ArgumentParser):
    """A parser that refuses an argument it does not know itself, naming the nearest flag. A
    subcommand's parser so answers a mistake with its own usage: argparse hands a subcommand's
    leftovers up to the top-level parser, whose usage and flags are not the subcommand's."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # A namespace of our own, as argparse would make: its type is then Namespace, not None.
        ns, extras = super().parse_known_args(args, namespace or argparse.Namespace())
        model = getattr(ns, "model_tag", None)
        if model in _COMMAND_WORDS and not os.path.exists(model):
            self.error(_command_as_model(model))
        if extras:
            self.error(self._unrecognized(extras))
        return ns, extras

    def _unrecognized(self, extras: list[str]) -> str:
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        named = []
        for arg in extras:
            near = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1)
            named.append(f"{arg} (did you mean {near[0]}?)" if arg[:1] == "-" and near else arg)
        return (
            f"unrecognized argument{'s' if len(extras) > 1 else ''}: {', '.join(named)}; "
            f"{self.prog} --help lists them all"
        )


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: "--por 9999" must not be taken for "--port", or a prefix
    # could slip a managed flag past a check that looks for the full name (the operator's).
    parser = FlagParser(prog="kvfleet-engine", description=__doc__, allow_abbrev=False)
    add_log_flags(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    # The usage lines are short: the flags are listed once, in --help, and a usage error is
    # the usage line and one line of what is wrong, not the list of every flag.
    gen = sub.add_parser(
        "generate",
        help="complete prompts offline and print the results",
        usage="%(prog)s --prompt TEXT [--prompt TEXT ...] [options]",
        allow_abbrev=False,
    )
    gen.add_argument("--prompt", action="append", required=True, help="a prompt; repeatable")
    gen.add_argument(
        "--max-tokens", type=int, default=32, help="tokens generated per completion" + DEFAULT
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0 samples greedily" + DEFAULT)
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass" + DEFAULT)
    gen.add_argument("--top-k", type=int, default=0, help="0 keeps every token" + DEFAULT)
    gen.add_argument("--n", type=int, default=1, help="completions per prompt" + DEFAULT)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    add_log_flags(gen, defaults=False)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        usage="%(prog)s [MODEL] [options]",
        allow_abbrev=False,
    )
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
    add_engine_args(srv)
    add_model_flags(srv, ServerSettings, "server")
    add_tracing_flag(srv)
    add_log_flags(srv, defaults=False)
    srv.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if getattr(ns, "model_tag", None) and ns.model is None:
        ns.model = ns.model_tag
    configure_logging(ns.log_level, ns.log_format)
    # Before anything imports transformers.
    keep_out_unused_packages()
    try:
        return ns.func(ns)
    except ValidationError as e:
        logger.error("%s", one_line(e))
        return EXIT_START_ERROR
    except (ValueError, OSError, TracingUnavailable) as e:
        # One line, whatever a library put in its message.
        logger.error("%s", " ".join(str(e).split()))
        return EXIT_START_ERROR
    except KeyboardInterrupt:
        # Ctrl-C before the server's own handling of it (importing, fetching the default
        # model) or while `generate` runs.
        logger.warning("interrupted")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
