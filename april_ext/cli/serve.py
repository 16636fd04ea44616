"""`april-ext serve`: the embedded engine behind the SGLang HTTP API.

The flags follow `python -m sglang.launch_server` where they overlap (--model-path, --port,
--enable-memory-saver, ...), so the SGLang launcher can start this server as a stand-in.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from april_ext.engine import AsyncEngine, EngineConfig, EngineCore
from april_ext.errors import AprilError, ConfigError
from april_ext.model import LlamaForCausalLM, ModelConfig
from april_ext.model.config import DTYPES
from april_ext.protocol.sglang_dialects import DIALECTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", "--model-path", dest="model", metavar="PATH",
                       help="Hugging Face style checkpoint directory (config.json + safetensors)")
    model.add_argument("--random-init-config", metavar="PATH",
                       help="config.json (or a directory holding one): randomly initialised weights, for tests")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed at start)")
    parser.add_argument("--weight-version", default="default", help="label of the initial weights")
    parser.add_argument("--seed", type=int, default=0, help="random init seed and the engine's sampling seed")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's dtype")
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV cache pages")
    parser.add_argument("--block-size", "--page-size", dest="block_size", type=int, default=16)
    parser.add_argument("--max-num-seqs", "--max-running-requests", dest="max_num_seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", "--chunked-prefill-size", dest="max_num_batched_tokens",
                        type=int, default=2048)
    parser.add_argument("--max-model-len", "--context-length", dest="max_model_len", type=int, default=None)
    parser.add_argument("--attention-backend", choices=("auto", "torch", "triton"), default="auto")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="tokens between two events of a streamed request (events are cumulative)")
    parser.add_argument("--max-request-bytes", type=int, default=64 << 20,
                        help="largest request body (default 64 MiB); a larger one answers 413 unread")
    parser.add_argument("--enable-memory-saver", action="store_true",
                        help="allow /release_memory_occupation (as in SGLang)")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true",
                        help="keep a host copy of released weights, so resume restores them without an update")
    parser.add_argument("--tokenizer-path", default=None, metavar="DIR",
                        help="a Hugging Face tokenizer directory: /generate then takes text and answers with text")
    parser.add_argument("--skip-tokenizer-init", action="store_true",
                        help="token ids only, even with --tokenizer-path (as SGLang)")
    parser.add_argument("--sglang-compat", choices=sorted(DIALECTS), default="current",
                        help="mimic the endpoints and request fields of this SGLang release line (for testing "
                             "clients against older SGLang servers)")
    parser.add_argument("--weight-group-timeout", type=float, default=60.0, metavar="S",
                        help="seconds joining the trainer's weight group and each weight broadcast may wait for "
                             "the other ranks")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="as SGLang: every request but /health and /health_generate needs "
                             "'Authorization: Bearer KEY' (401 otherwise); without it, a --host beyond loopback warns")
    parser.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1, help="only 1 (one engine process)")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Adds the `serve` subcommand; its handler is `args.func(args) -> int`."""
    parser = subparsers.add_parser("serve", help="serve the embedded engine over the SGLang HTTP API",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def build_core(args: argparse.Namespace) -> EngineCore:
    if args.tp != 1:
        raise ConfigError(f"--tp must be 1 for the embedded engine, got {args.tp}")
    config = EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                          device=args.device, attention_backend=args.attention_backend, seed=args.seed,
                          weights_cpu_backup=args.enable_weights_cpu_backup)
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.model is not None:
        return EngineCore.from_pretrained(args.model, config, dtype=dtype)
    model = LlamaForCausalLM(ModelConfig.from_pretrained(args.random_init_config), device=args.device, dtype=dtype)
    model.init_weights(seed=args.seed)
    return EngineCore(model, config)


def run(args: argparse.Namespace) -> int:
    # The server needs aiohttp: imported here, so the command line registers `serve` without it.
    from april_ext.server.app import ServerConfig
    from april_ext.server.foreground import serve

    core = build_core(args)
    config = ServerConfig(host=args.host, port=args.port, model_path=args.model or args.random_init_config,
                          weight_version=args.weight_version, enable_memory_saver=args.enable_memory_saver,
                          stream_interval=args.stream_interval, max_request_bytes=args.max_request_bytes,
                          tokenizer_path=None if args.skip_tokenizer_init else args.tokenizer_path,
                          sglang_compat=args.sglang_compat, weight_group_timeout_s=args.weight_group_timeout,
                          api_key=args.api_key)
    asyncio.run(serve(AsyncEngine(core), config))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m april_ext.server` (the launcher's stand-in module): the `serve` command on its own."""
    parser = argparse.ArgumentParser(prog="april-ext serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except AprilError as err:
        print(f"april-ext serve: error: {err}", file=sys.stderr)
        return 2


__all__ = ["add_arguments", "add_parser", "build_core", "main", "run"]
