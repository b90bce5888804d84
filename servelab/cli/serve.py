"""``servelab serve MODEL [every pipeline option]``: the OpenAI-compatible server.

``MODEL`` is a checkpoint folder, a ``.gguf`` file, ``smollm2`` or
``gemma3-270m`` (fetched once, as for ``servelab demo``), or ``tiny`` (the
embedded tiny Llama, random weights). Every :class:`~servelab.PipelineConfig`
setting is an option (``--block-size 16``, ``--policy sjf``,
``--enable-prefix-caching false``...): its value is read as an int, a float,
``true``/``false`` or ``none`` when it looks like one, else as a string, and
the pipeline checks it (a bad one exits with status 2 and one line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from servelab.config import PipelineConfig, flat_names

__all__ = ["add_parser", "parse_setting", "run"]


def parse_setting(text: str) -> Any:
    """``"16"`` -> 16, ``"0.5"`` -> 0.5, ``"true"`` -> True, ``"none"`` -> None, else the string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _default(name: str, section: str) -> Any:
    config = PipelineConfig()
    holder = config if section == "top" else getattr(config, section)
    return getattr(holder, name)


def add_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (the 'serve' extra)",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("model", help="checkpoint folder, .gguf file, smollm2, gemma3-270m, or tiny")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: %(default)s)")
    serve.add_argument("--served-model-name", default=None, help="the name clients pass as model "
                       "(default: the MODEL argument)")
    serve.add_argument("--max-waiting", type=int, default=1024,
                       help="requests waiting for admission before 503 (default: %(default)s)")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template (a file or the text), or 'chatml', for a tokenizer without one")
    serve.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default; default: %(default)s)")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                       help="uvicorn's log level (default: %(default)s)")
    group = serve.add_argument_group("pipeline settings (servelab.PipelineConfig)")
    for name, section in sorted(flat_names().items()):
        default = _default(name, section)
        if not isinstance(default, (int, float, str, bool, type(None))):
            continue
        group.add_argument(f"--{name.replace('_', '-')}", dest=f"setting_{name}", type=parse_setting,
                           default=argparse.SUPPRESS, metavar="VALUE",
                           help=f"PipelineConfig.{name} ({section} section; default: {default!r})")


def _chat_template(value: str | None) -> str | None:
    from servelab.serve.chat import CHATML_TEMPLATE

    if value is None:
        return None
    if value.lower() == "chatml":
        return CHATML_TEMPLATE
    path = Path(value)
    return path.read_text() if path.is_file() else value


def run(args: argparse.Namespace) -> int:
    """Build the pipeline, then serve until interrupted."""
    try:
        from servelab.serve import require_serve_extra

        require_serve_extra()
    except ImportError as exc:
        print(f"servelab serve: error: {exc}", file=sys.stderr)
        return 2
    import torch

    from servelab import Pipeline
    from servelab.cli.demo import resolve_demo_model
    from servelab.serve.server import run_server

    if args.threads:
        torch.set_num_threads(args.threads)
    settings = {key.removeprefix("setting_"): value for key, value in vars(args).items()
                if key.startswith("setting_")}
    try:
        model = None if args.model == "tiny" else args.model
        path, note = resolve_demo_model(model, Path.home() / ".cache" / "servelab" / "serve-tiny")
        pipe = Pipeline.from_pretrained(path, **settings)
        template = _chat_template(args.chat_template)
    except (ValueError, TypeError, OSError, ImportError, RuntimeError) as exc:
        print(f"servelab serve: error: {' '.join(str(exc).split())[:600]}", file=sys.stderr)
        return 2
    if template is None and not getattr(pipe.tokenizer, "chat_template", None):
        print("servelab serve: the tokenizer has no chat template: /v1/chat/completions answers 400 "
              "(give --chat-template chatml or a template)", file=sys.stderr)
    name = args.served_model_name or args.model
    print(f"servelab serve: {note}\nserving {name!r} on http://{args.host}:{args.port}/v1 "
          f"(attention {pipe.attention_backend}, {pipe.num_blocks} KV blocks of {pipe.block_size})", flush=True)
    run_server(pipe, name, host=args.host, port=args.port, max_waiting=args.max_waiting, chat_template=template,
               log_level=args.log_level)
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="servelab")
    add_parser(parser.add_subparsers(dest="command"))
    sys.exit(run(parser.parse_args()))
