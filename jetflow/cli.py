"""The ``jetflow`` command line. Each subcommand parses its arguments and calls the Python API."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from jetflow.errors import InvalidRequestError, JetFlowError


def _refine_mode(value: str) -> int | str:
    from jetflow.decoding.refine import tree_passes

    try:
        if value.startswith("tree"):
            tree_passes(value)  # refuses a malformed one
            return value
        if int(value) >= 1:
            return int(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected a number of passes >= 1, 'tree' or 'tree:N', got {value!r}")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="short name, HF model dir, .gguf file or hub id (default: smollm2-135m-instruct)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "llamacpp"],
                   help="target runtime: llamacpp runs a GGUF file as is with llama.cpp; torch runs transformers; "
                        "auto (default): llamacpp for GGUF targets on the CPU when llama-cpp-python is installed, "
                        "else torch (training commands always use torch)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="compute threads of llama.cpp and torch (default: every CPU this process may use)")
    p.add_argument("--flash-attn", choices=["on", "off"], default="off",
                   help="llama.cpp's fused attention kernel: faster decoding, but outputs are no longer guaranteed "
                        "identical to one-token decoding (its one-row and many-row kernels sum in different orders "
                        "once 512 cache cells are in view or 64 rows are decoded); default off")


def _add_data_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, type=Path, action="append", metavar="DIR",
                   help="a `jetflow regenerate` output directory; repeat to use several, read in the order given "
                        "(keep one that is still growing last)")


def _add_offline_eval_args(p: argparse.ArgumentParser, drafter_help: str) -> None:
    """Target, drafters and held-out data of the offline evaluations (eval-offline, eval-agreement)."""
    _add_target_args(p)
    p.add_argument("--drafter", required=True, action="append", help=drafter_help)
    _add_data_arg(p)
    p.add_argument("--teacher-cache", type=Path, default=None,
                   help="a `jetflow cache-teacher` directory for --data (default: run the target online)")
    p.add_argument("--sequences", type=_sequence_range, default=None,
                   help="START:END range of sequences in shard order, e.g. sequences no head under test was "
                        "trained on (default: all)")


def _device_and_dtype(args):
    import torch

    from jetflow.models.loading import default_device_and_dtype

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)  # the torch runtime, and the heads that draft for llama.cpp
    return default_device_and_dtype(args.device, getattr(torch, args.dtype) if args.dtype else None,
                                    getattr(args, "backend", "auto"))


def _check_drafter_dirs(paths) -> None:
    """JetFlowError naming the first path that is not a drafter checkpoint directory."""
    for path in map(Path, paths):
        if path.is_dir():
            continue
        raise JetFlowError(f"drafter checkpoint must be a directory (config.json + model.safetensors), got a file: "
                           f"{path}" if path.exists() else f"drafter checkpoint directory not found: {path}")


def _unescape(text: str) -> str:
    """A command-line string with the escapes \\n, \\t, \\r and \\\\ turned into what they name (a
    shell passes "\\n" on as backslash and n); other backslashes stay as they are."""
    import re

    return re.sub(r"\\([ntr\\])", lambda m: {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[m.group(1)], text)


def _load_jetflow(args):
    from jetflow.pipeline import JetFlow

    device, dtype = _device_and_dtype(args)
    drafter = args.drafter
    if drafter.lower() not in ("none", "auto"):
        _check_drafter_dirs([drafter])
    jf = JetFlow.from_pretrained(args.target, drafter, device=device, dtype=dtype, backend=args.backend,
                                 n_threads=args.threads, flash_attn=args.flash_attn == "on",
                                 budget=args.budget, width=args.width,
                                 lookup=not args.no_lookup, int8_draft=_int8_draft(args),
                                 auto_state=_auto_state_dir(args.auto_state))
    if args.dtype and jf.target.backend == "llamacpp":
        print(f"[--dtype {args.dtype} applies to the torch backend; llama.cpp runs the GGUF's own types]", file=sys.stderr)
    if drafter.lower() == "auto" and jf.drafter is None:
        print(f"[no drafter ships for {jf.target.name}: decoding without one; train one (`jetflow train`) and "
              "pass it with --drafter DIR]", file=sys.stderr)
    return jf


def _new_checkpoint_dir(out, source, overwrite: bool, replaceable, in_place: bool = False) -> None:
    """--out of a command that writes a checkpoint made from ``source``: a directory that already
    holds one is replaced only with --overwrite (and ``source`` itself only where the command
    rewrites in place), so another head is never lost to a mistyped path; even then it may hold
    nothing but ``replaceable`` (what the command writes). Checked before the model loads."""
    from jetflow.utils.fs import check_replaceable, check_writable_dir

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise JetFlowError(f"--out {out} is a file, not a directory")
    check_writable_dir(out.parent, what=f"--out {out}", keep=False)
    if out.exists() and out.resolve() == Path(source).resolve():
        if in_place:
            return
        raise JetFlowError(f"--out {out} is the --drafter itself; write to another directory")
    if out.is_dir() and any(out.iterdir()):
        check_replaceable(out, replaceable)  # files of the user's: not even --overwrite replaces them
        if not overwrite:
            raise JetFlowError(f"--out {out} already holds a checkpoint; --overwrite replaces it, "
                               "or choose a new directory")


def _report_file(path) -> None:
    """--out/--report of a JSON report: refused now if it could not be written at the end."""
    from jetflow.utils.fs import check_writable_file

    if path is not None:
        check_writable_file(Path(path))


def _auto_state_dir(text: str) -> Path | None:
    """--auto-state: None for 'none', else a writable directory."""
    return None if text.lower() == "none" else _writable_dir(text, "--auto-state")


def _writable_dir(text: str, flag: str) -> Path:
    """A directory that exists or can be made, and is writable: checked before a model loads, not
    when the first result is to be saved."""
    if not text.strip():
        raise JetFlowError(f"{flag} must name a directory, got an empty string")
    from jetflow.utils.fs import check_writable_dir

    path = Path(text)
    if path.exists() and not path.is_dir():
        raise JetFlowError(f"{flag} {text} is a file, not a directory")
    check_writable_dir(path, what=f"{flag} {text}")
    return path


def _add_overwrite_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="replace the checkpoint --out already holds (a directory holding other files is still refused)")


def _add_draft_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-weights", choices=["auto", "float", "int8"], default="auto",
                   help="the draft head's weights in its forward: int8 (dynamically quantized; the draft only, "
                        "never what is accepted) or float; auto (default): int8 on the CPU, float on a GPU")


def _add_auto_state_arg(p: argparse.ArgumentParser, note: str = "") -> None:
    from jetflow.utils.fs import cache_root

    p.add_argument("--auto-state", default=str(cache_root() / "auto_state"), metavar="DIR|none",
                   help="where --budget auto keeps what it learns (acceptance, costs, whether the head pays) from "
                        f"one run to the next, per machine and head (default: %(default)s); 'none': start from "
                        f"nothing{note}")


def _add_decoding_args(p: argparse.ArgumentParser) -> None:
    """What generate and chat decode with: length, sampling, stops, the drafter and its trees."""
    p.add_argument("--max-new-tokens", type=_positive_int, default=256, help="(default: %(default)s)")
    p.add_argument("--temperature", type=_number, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=_number, default=1.0, help="nucleus sampling (default: %(default)s, off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default: 0, off)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable); \\n, \\t, \\r and \\\\ are escapes")
    p.add_argument("--drafter", default="auto",
                   help="draft head checkpoint dir; 'none' for plain autoregressive decoding; 'auto' (default): "
                        "the drafter shipped for the target if there is one, else none")
    p.add_argument("--budget", type=_budget, default=None,
                   help="draft tree nodes per round, root not counted, or 'auto': chosen every round from the "
                        "machine's cost curve and the acceptance so far (default: auto on the CPU, where a verify's "
                        "cost grows with its tokens; 16 on a GPU)")
    p.add_argument("--width", type=_positive_int, default=7,
                   help="top-w candidates per depth (1 = chain; default: %(default)s)")
    p.add_argument("--no-lookup", action="store_true",
                   help="draft from the head alone (default: prompt-lookup candidates join the head's tree)")
    _add_draft_weights_arg(p)
    _add_auto_state_arg(p)


def _int8_draft(args) -> bool | None:
    return {"auto": None, "float": False, "int8": True}[args.draft_weights]


def _comparison(spec, ar, drafter) -> str:
    """JetFlow vs autoregressive decoding of the same request, as a small table."""
    rows = [("", "autoregressive", "JetFlow"),
            ("new tokens", str(ar.new_tokens), str(spec.new_tokens)),
            ("seconds", f"{ar.seconds:.2f}", f"{spec.seconds:.2f}"),
            ("tokens/s", f"{ar.tokens_per_s:.1f}", f"{spec.tokens_per_s:.1f}"),
            ("tau (tokens/round)", "1.00", f"{spec.stats['tau']:.2f}" if spec.stats.get("tau") is not None else "-"),
            ("speed-up", "1.00x", f"{spec.tokens_per_s / ar.tokens_per_s:.2f}x" if ar.tokens_per_s else "-")]
    lines = [f"{a:<20}{b:>16}{c:>16}" for a, b, c in rows]
    same = "identical" if spec.token_ids == ar.token_ids else "DIFFERENT"
    lines.append(f"text: {same} ({len(ar.token_ids)} vs {len(spec.token_ids)} tokens); drafter: {drafter or 'none'}")
    return "\n".join(lines)


def _number(text: str) -> float:
    """A finite number (argparse's float takes nan and inf, which no option here means)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {value}")
    return value


def _replay_passes(text: str) -> int | str:
    """eval-offline's --refine-passes: N >= 0 path passes, or 'tree' / 'tree:N'."""
    return _refine_mode(text) if text.startswith("tree") else _non_negative_int(text)


def _budget(text: str) -> int | str:
    from jetflow.pipeline import MAX_BUDGET

    if text.lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a node count in [0, {MAX_BUDGET}], got {text!r}") from None
    if not 0 <= value <= MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a node count in [0, {MAX_BUDGET}], got {value}")
    return value


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _sequence_range(text: str) -> str:
    """A START:END range (either side may be empty), checked before any model loads; whether it
    lies inside the data is checked once the data is read."""
    from jetflow.eval.offline_acceptance import parse_range

    try:
        parse_range(text, 1 << 62)
    except JetFlowError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _data_dir(text: str) -> Path:
    """A `jetflow regenerate` output: a directory holding token shards."""
    from jetflow.data.shards import list_shards

    path = Path(text).expanduser()
    if not path.is_dir() or not list_shards(path):
        raise argparse.ArgumentTypeError(f"{text} is not a regenerated data directory (no shard-NNNNN.npz files)")
    return path


def cmd_generate(args) -> int:
    import secrets

    from jetflow.decoding.reference import generate_with_reference
    from jetflow.decoding.sampling import SamplingParams

    # Fail on bad input before spending seconds on loading a model.
    request = _request_args(args)
    if args.prompt == "-":  # as a text file holds it: a BOM, Windows line ends and the last line end are not prompt
        text = sys.stdin.read().removeprefix("\ufeff").replace("\r\n", "\n")
        args.prompt = text[:-1] if text.endswith("\n") else text
    if not args.prompt.strip():
        raise JetFlowError("empty prompt")
    reference = args.check_lossless or args.compare
    seed = request.pop("seed")
    if reference and seed is None and not SamplingParams(args.temperature).greedy:
        # Sampling is lossless in distribution: both runs must draw from the same seeded generator.
        seed = secrets.randbits(63)
        print(f"[sampling with seed {seed} in both runs]", file=sys.stderr)
    jf = _load_jetflow(args)
    request.update(seed=seed, chat=args.chat)
    result, reference = generate_with_reference(jf, args.prompt, reference=reference,
                                                on_delta=None if args.json else _write_delta, **request)
    lossless = None if reference is None else reference.token_ids == result.token_ids
    if args.json:
        out = result.to_dict()
        out.update(target=jf.target.name, drafter=jf.drafter_path, seed=seed)
        if reference is not None:
            out["autoregressive"] = {"tokens_per_s": reference.tokens_per_s, "seconds": reference.seconds}
        for key in ("tau", "rounds", "accept_lengths", "budget", "mean_tree_size"):
            out[key] = result.stats.get(key)
        if lossless is not None:
            out["lossless"] = lossless
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        extra = (f", tau {result.stats['tau']:.2f} over {result.stats['rounds']} rounds"
                 if result.stats.get("tau") is not None else "")
        cached = f", {result.cached_prompt_tokens} cached" if result.cached_prompt_tokens else ""
        print(f"[{result.new_tokens} tokens in {result.seconds:.2f} s, {result.tokens_per_s:.1f} tok/s; prefill "
              f"{result.prefill_seconds:.2f} s ({result.prompt_tokens} prompt tokens{cached}), then "
              f"{result.decode_tokens_per_s:.1f} tok/s{extra}, finish: {result.finish_reason}]", file=sys.stderr)
        if args.compare:
            print(_comparison(result, reference, jf.drafter_path), file=sys.stderr)
    if lossless is False:
        print("jetflow: error: speculative output differs from autoregressive output", file=sys.stderr)
        return 1
    if lossless:
        print("[lossless check passed: identical to autoregressive decoding]", file=sys.stderr)
    return 0


def _request_args(args) -> dict:
    """The request options of generate and chat, checked before a model loads."""
    from jetflow.decoding.sampling import SamplingParams

    SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    stop = [_unescape(s) for s in args.stop or ()]
    if any(not s for s in stop):
        raise JetFlowError("--stop strings must be non-empty")
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, stop=stop or ())


CHAT_HELP = ("a line is a turn; /reset starts a new conversation, /exit or Ctrl-D ends; "
             "start a line with // to send one that starts with /")


def cmd_chat(args) -> int:
    """A conversation in the terminal: every line read is a user turn, answered with the whole
    conversation so far as the prompt (whose shared prefix the next turn takes from the cache)."""
    request = _request_args(args)
    jf = _load_jetflow(args)
    from jetflow.decoding.conversation import Conversation
    from jetflow.decoding.prompt import has_chat_template

    if not has_chat_template(jf.target.tokenizer):
        raise JetFlowError(f"jetflow chat needs a model with a chat template; {jf.target.name} has none "
                           "(use jetflow generate --no-chat)")
    conversation = Conversation(jf.target.tokenizer, system=args.system)
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not text become U+FFFD rather than end the chat
        sys.stdin.reconfigure(errors="replace")
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"[{CHAT_HELP}]", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        text = line.removeprefix("\ufeff").rstrip("\r\n")
        command = text.strip().lower()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            conversation.reset()
            print("[a new conversation]", file=sys.stderr)
            continue
        if command.startswith("/") and not command.startswith("//") and len(command.split()) == 1:
            print(f"[{CHAT_HELP}]", file=sys.stderr)  # /help, or a command that does not exist
            continue
        if text.lstrip().startswith("//"):  # a turn that starts with '/'
            text = text.replace("//", "/", 1)
        try:
            result = None
            for event in jf.stream(conversation.prompt(text), **request):
                if isinstance(event, str):
                    _write_delta(event)
                else:
                    result = event
        except InvalidRequestError as e:  # e.g. the conversation outgrew the context: it stays as it was
            hint = "; /reset starts a new conversation" if "context" in str(e) else ""
            print(f"\n[turn not answered: {e}{hint}]", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # Ctrl-C stops this answer, not the chat (a second one at the prompt ends it)
            jf.target.reset()  # (the interrupt may have come between a forward and its bookkeeping)
            print("\n[turn interrupted: not part of the conversation]", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        assert result is not None  # a stream ends with its result
        conversation.add_answer(result)
        tau = f", tau {result.stats['tau']:.2f}" if result.stats.get("rounds") else ""  # (none without a round)
        tokens = f"{result.new_tokens} token{'s' if result.new_tokens != 1 else ''}"
        print(f"[{tokens}, {result.tokens_per_s:.1f} tok/s{tau}; {result.prompt_tokens} prompt tokens, "
              f"{result.cached_prompt_tokens} from the cache, first token after {result.prefill_seconds:.2f} s; "
              f"finish: {result.finish_reason}]", file=sys.stderr)
    return 0


def _write_delta(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_regenerate(args) -> int:
    from jetflow.data.prompts import load_prompts
    from jetflow.data.regenerate import regenerate
    from jetflow.data.shards import list_shards, read_shard

    mix = None
    if args.mix:
        try:
            mix = {k: float(v) for k, v in (item.split("=", 1) for item in args.mix.split(","))}
        except ValueError:
            raise JetFlowError(f"--mix must look like gsm8k-train=0.5,sharegpt=0.5, got {args.mix!r}") from None
    if args.temperature < 0:
        raise JetFlowError(f"--temperature must be >= 0, got {args.temperature}")
    exclude = {seq.prompt_id for data in args.exclude for shard in list_shards(data) for seq in read_shard(shard)}
    prompts = load_prompts(args.prompts, num=args.num, seed=args.seed, mix=mix, exclude=exclude)
    if not prompts:
        raise JetFlowError(f"no prompts loaded from {args.prompts!r}")
    _writable_dir(str(args.out), "--out")
    target = _load_jetflow_target(args)  # either backend: regeneration only generates
    manifest = regenerate(target, prompts, args.out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                          shard_size=args.shard_size, temperature=args.temperature, seed=args.seed,
                          sources=args.prompts, mix=mix, answers=args.answers)
    print(json.dumps({"out": str(args.out), "complete": manifest["complete"], **manifest["totals"],
                      "wall_seconds": round(manifest["wall_seconds"], 1)}))
    return 0


def cmd_train(args) -> int:
    from jetflow.training.distributed import init_distributed, is_main_process
    from jetflow.training.run import head_target_layers, train_drafter
    from jetflow.training.trainer import TrainConfig

    config = TrainConfig(loss=args.loss, kl_temperature=args.kl_temperature, gamma=args.gamma,
                         attention=args.attention, block_size=args.block_size, anchors_per_seq=args.anchors_per_seq,
                         layers=args.layers, lr=args.lr, epochs=args.epochs, batch_size=args.batch,
                         grad_accum=args.grad_accum, warmup_steps=args.warmup, seed=args.seed,
                         save_every=args.save_every, eval_every=args.eval_every, draft_vocab=args.draft_vocab,
                         feed_last_feature=args.feed_last_feature, depth_embedding=args.depth_embedding,
                         head=args.head, ttt_steps=args.ttt_steps, dense_depth1=_dense_depth1(args),
                         dense_depth1_anchors=args.dense_depth1_anchors,
                         embed_norm=args.embed_norm, reveal=args.reveal, slot_token_gain=args.slot_token_gain,
                         shift_tokens=args.shift_tokens, path_projection=args.path_projection, amp=args.amp,
                         max_seconds=args.max_seconds, pack_sequences=args.pack_sequences)
    from jetflow.models.draft_head import CHECKPOINT_FILES
    from jetflow.utils.fs import check_replaceable

    fractions = _fractions(args.snapshot_at)
    _writable_dir(str(args.out), "--out")
    check_replaceable(Path(args.out) / "drafter", CHECKPOINT_FILES)  # where the head goes: refused now, not after training
    layers = _layer_ids(args.target_layers, "--target-layers") if args.target_layers is not None else None
    head_target_layers(args.out, target_layers=layers, init_from=args.init_from, teacher_cache=args.teacher_cache,
                       resume=args.resume)  # (a conflict of layers: refused before the model loads)
    init_distributed()
    target = _load_jetflow_target(args, training=True)
    result = train_drafter(target, args.data, args.out, config, init_from=args.init_from,
                           max_sequences=args.max_sequences, teacher_cache=args.teacher_cache, resume=args.resume,
                           max_steps=args.max_steps, snapshot_at=tuple(fractions), target_layers=layers)
    if is_main_process():
        print(json.dumps(result))
    return 0


def _dense_depth1(args) -> float:
    """--dense-depth1: on by default (weight 1) for causal block heads, which it helps
    (docs/results.md, "Closing the depth-1 gap"); off for the heads it does not apply to."""
    if args.dense_depth1 is not None:
        return args.dense_depth1
    return 1.0 if args.head == "block" and args.attention == "causal" else 0.0


def _fractions(text: str | None) -> list[float]:
    if not text:
        return []
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise JetFlowError(f"--snapshot-at must be fractions like 0.25,0.5, got {text!r}") from None
    if any(not 0 < v <= 1 for v in values):
        raise JetFlowError(f"--snapshot-at fractions must be in (0, 1], got {text!r}")
    return values


def cmd_cache_teacher(args) -> int:
    from jetflow.training.run import tap_layers
    from jetflow.training.teacher_cache import build_teacher_cache
    from jetflow.training.trainer import data_label, load_sequences

    _writable_dir(str(args.out), "--out")
    layers = _layer_ids(args.layers, "--layers") if args.layers else None  # (checked before the model loads)
    layers = _stored_layer_order(args.out, layers)
    target = _load_jetflow_target(args, training=True)
    if layers:
        tap_layers(target, "--layers", layers)
    sequences = load_sequences(args.data, target, args.max_sequences)
    manifest = build_teacher_cache(target, sequences, args.out, top_k=args.top_k,
                                   sequences_per_part=args.part_size, batch_tokens=args.batch_tokens,
                                   source=data_label(args.data))
    print(json.dumps({"out": str(args.out), "complete": manifest["complete"], "sequences": manifest["num_sequences"],
                      "wall_seconds": round(manifest["wall_seconds"], 1)}))
    return 0


def cmd_data_stats(args) -> int:
    from jetflow.data.stats import data_stats, format_stats

    stats = data_stats(args.data, long_answer=args.long_answer, drafters=[Path(d) for d in args.drafter])
    print(json.dumps(stats) if args.json else format_stats(stats))
    return 0


def cmd_eval_offline(args) -> int:
    from jetflow.eval.offline_acceptance import evaluate_drafters
    from jetflow.eval.replay_journal import journal_path
    from jetflow.utils.fs import write_json_atomic

    _check_drafter_dirs(args.drafter)
    from jetflow.pipeline import MAX_BUDGET

    budgets = _int_list(args.budgets, "--budgets")
    if min(budgets) < 1 or max(budgets) > MAX_BUDGET:
        raise JetFlowError(f"--budgets must be in [1, {MAX_BUDGET}], got {args.budgets!r}")
    _report_file(args.out)
    target = _load_jetflow_target(args, training=True)
    journal = journal_path(args.out) if args.out else None  # an interrupted replay resumes from it
    report = evaluate_drafters(target, args.drafter, args.data, args.teacher_cache, args.sequences, budgets,
                               args.width, args.anchors_per_seq, args.seed, log=lambda m: print(m, file=sys.stderr),
                               refine=0 if args.no_refine else args.refine_passes,
                               lookup=args.lookup or args.lookup_session,
                               calibrated=not args.no_calibration, lookup_session=args.lookup_session,
                               journal=journal, progress=True)
    if args.out:
        write_json_atomic(args.out, report)
        journal.unlink(missing_ok=True)
    print(json.dumps(report["drafters"]))
    return 0


def cmd_calibrate(args) -> int:
    from jetflow.eval.calibrate import calibrate_drafter
    from jetflow.utils.fs import write_json_atomic

    _check_drafter_dirs([args.drafter])
    from jetflow.models.draft_head import read_config

    if (kind := read_config(args.drafter).kind) != "block":  # (before the model and the data load)
        raise JetFlowError(f"tree calibration is for block heads; {args.drafter} is a {kind!r} head")
    if args.held_out and args.sequences:
        raise JetFlowError("give --held-out or --sequences, not both")
    if not args.held_out and not args.sequences:
        raise JetFlowError("say which sequences the head was not trained on: --held-out (the split `jetflow train` "
                           "held out, with its --seed) or --sequences START:END")
    if args.max_sequences is not None and not args.held_out:
        raise JetFlowError("--max-sequences says which sequences the training run split: it goes with --held-out")
    if args.out is not None:  # (the calibrated copy holds the drafter's own files)
        _new_checkpoint_dir(args.out, args.drafter, args.overwrite, [f.name for f in Path(args.drafter).iterdir()],
                            in_place=True)
    _report_file(args.report)
    target = _load_jetflow_target(args, training=True)
    report = calibrate_drafter(target, args.drafter, args.data, args.out or args.drafter,
                               teacher_cache=args.teacher_cache, seq_range=args.sequences,
                               held_out=args.seed if args.held_out else None, max_sequences=args.max_sequences,
                               width=args.width, log=lambda m: print(m, file=sys.stderr))
    if args.report:
        write_json_atomic(args.report, report)
    return 0


def cmd_draft_vocab(args) -> int:
    from jetflow.training.revocab import widen_drafter_vocab

    _check_drafter_dirs([args.drafter])
    from jetflow.models.draft_head import CHECKPOINT_FILES

    if Path(args.out).resolve() == Path(args.drafter).resolve():
        raise JetFlowError("--out must be a new directory (the widened head drops the tree calibration; "
                           "run `jetflow calibrate --out` on it afterwards)")
    _new_checkpoint_dir(args.out, args.drafter, args.overwrite, CHECKPOINT_FILES)
    from jetflow.models.draft_head import read_config
    from jetflow.models.draft_vocab import check_widening

    config = read_config(args.drafter)  # (its sizes are checked before the model and the data load)
    if args.size > config.vocab_size:  # (the head's vocabulary is its target's: loading it checks that)
        raise JetFlowError(f"--size must be at most the target's vocabulary, {config.vocab_size} "
                           f"(0: the whole vocabulary), got {args.size}")
    try:
        check_widening(config.draft_vocab_size if config.reduced_vocab else None, args.size, config.vocab_size)
    except ValueError as e:
        raise JetFlowError(f"{args.drafter}: {e}") from None
    target = _load_jetflow_target(args, training=True)
    report = widen_drafter_vocab(target, args.drafter, args.data, args.size, args.out, seed=args.seed,
                                 max_sequences=args.max_sequences)
    print(json.dumps(report))
    return 0


def cmd_eval_agreement(args) -> int:
    from jetflow.eval.depth_agreement import evaluate_agreement
    from jetflow.utils.fs import write_json_atomic

    _check_drafter_dirs(args.drafter)
    _report_file(args.out)
    target = _load_jetflow_target(args, training=True)
    report = evaluate_agreement(target, args.drafter, args.data, args.teacher_cache, args.sequences, args.max_depth,
                                log=lambda m: print(m, file=sys.stderr), path_conditioned=args.path_conditioned)
    if args.out:
        write_json_atomic(args.out, report)
    print(json.dumps({k: {"agreement": v["agreement"], "prefix_agreement": v["prefix_agreement"]}
                      for k, v in report["drafters"].items()}))
    return 0


def cmd_bench(args) -> int:
    from jetflow.eval.bench import run_bench
    from jetflow.eval.datasets import load_eval_set
    from jetflow.eval.methods import check_sampling, parse_methods, reference_method

    methods = parse_methods(args.methods)
    from jetflow.decoding.sampling import SamplingParams

    budgets = _budget_list(args.budgets)
    params = SamplingParams(args.temperature, seed=args.seed)  # bad values fail before the model loads
    check_sampling(methods, params.greedy)
    loaded = [load_eval_set(name, args.limit) for name in dict.fromkeys(
        d.strip() for d in args.datasets.split(",") if d.strip())]
    datasets = {prompts[0].dataset: prompts for prompts in loaded}  # a .jsonl file is named after its stem
    if len(datasets) < len(loaded):
        raise JetFlowError("two --datasets have the same name (a .jsonl file is named after its file name stem)")
    if not datasets:
        raise JetFlowError("--datasets names no evaluation set")
    _writable_dir(str(args.out), "--out")
    target = _load_jetflow_target(args)
    methods = parse_methods(args.methods, reference_method(target, params.greedy))  # greedy llama.cpp: llama-ar
    drafters = {"causal": args.drafter, "bidirectional": args.baseline_drafter, "eagle3": args.eagle_drafter,
                "native": args.native_drafter}
    summary, mismatches = run_bench(target, methods, datasets, budgets, drafters, args.out, width=args.width,
                                    max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    seed=args.seed, limit=args.limit, repeats=args.repeats,
                                    cost_model=not args.no_cost_model, interleave=args.order == "interleaved",
                                    refine=args.refine, int8_draft=_int8_draft(args), overwrite=args.overwrite)
    print(json.dumps(summary))
    return 1 if mismatches else 0


def cmd_serve(args) -> int:
    import os

    from jetflow.models.llamacpp_batched import check_sequence_count
    from jetflow.serve.server import serve

    if args.backend != "torch" and args.max_batch > 1:  # before loading
        check_sequence_count(args.max_batch, args.prefix_cache_slots if args.prefix_cache == "on" else 0)

    def load():  # in the engine's thread: see jetflow/serve/server.py
        jf = _load_jetflow(args)
        jf.target.prefix_cache = args.prefix_cache == "on"
        return jf

    serve(load, host=args.host, port=args.port, max_queue=args.max_queue,
          api_key=args.api_key or os.environ.get("JETFLOW_API_KEY") or None, model_name=args.model_name,
          max_body_bytes=args.max_body_bytes, shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
          max_batch=args.max_batch, max_prefill_tokens=args.max_prefill_tokens,
          prefix_slots=args.prefix_cache_slots)
    return 0


def cmd_export_vllm(args) -> int:
    import torch

    from jetflow.export.vllm import EXPORT_FILES, export_vllm, speculative_config

    _check_drafter_dirs([args.drafter])
    _new_checkpoint_dir(args.out, args.drafter, args.overwrite, EXPORT_FILES)
    out = Path(export_vllm(args.drafter, args.out, dtype=getattr(torch, args.dtype), target=args.target)).absolute()
    print(json.dumps({"out": str(out), "speculative_config": speculative_config(out)}))
    return 0


def cmd_export_gguf(args) -> int:
    from jetflow.export.gguf import export_gguf, target_gguf_for
    from jetflow.models.checkpoint import load_drafter

    _check_drafter_dirs([args.drafter])
    if args.out.exists() and not args.out.is_dir() and not args.overwrite:  # before anything loads
        raise JetFlowError(f"--out {args.out} already exists; --overwrite replaces it")
    target_gguf = target_gguf_for(args.target or load_drafter(args.drafter).config.target.get("name"))
    out = export_gguf(args.drafter, args.out, target_gguf, dtype=args.dtype, overwrite=args.overwrite).absolute()
    print(json.dumps({"out": str(out), "target_gguf": str(target_gguf),
                      "run": f"llama-speculative-simple -m {target_gguf} -md {out} --spec-type draft-dflash --temp 0 "
                             "-fa off"}))
    return 0


def _budget_list(text: str) -> list[int | str]:
    """--budgets: sorted distinct integers >= 1, then 'auto' if asked for."""
    from jetflow.pipeline import MAX_BUDGET

    items = [t.strip() for t in text.split(",")]
    if not all(t == "auto" or t.isdigit() and 1 <= int(t) <= MAX_BUDGET for t in items):
        raise JetFlowError(f"--budgets must be comma-separated integers in [1, {MAX_BUDGET}] or 'auto', got {text!r}")
    return sorted({int(t) for t in items if t != "auto"}) + (["auto"] if "auto" in items else [])


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise JetFlowError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _stored_layer_order(cache_dir: Path, layers: list[int] | None) -> list[int] | None:
    """``layers`` in the order a cache in ``cache_dir`` already holds them, where it holds the same
    ones: a cache begun before layer ids were sorted keeps its order, so it can be completed."""
    from jetflow.training.teacher_cache import TEACHER_CACHE
    from jetflow.utils.fs import read_manifest

    stored = (read_manifest(cache_dir, TEACHER_CACHE) or {}).get("tapped_layers")
    if layers and isinstance(stored, list) and sorted(stored) == layers:
        return list(stored)
    return layers


def _layer_ids(text: str, flag: str) -> list[int]:
    """Target layer ids (0-based) to tap, sorted: the order of a head's features is not the user's
    concern, and so the same layers given in any order make the same cache and head. Whether the
    target has them is checked once it loads."""
    layers = _int_list(text, flag)
    if min(layers) < 0:
        raise JetFlowError(f"{flag} are 0-based layer ids, got {text!r}")
    if len(set(layers)) < len(layers):
        raise JetFlowError(f"{flag} names a layer twice: {text!r}")
    return sorted(layers)


def _load_jetflow_target(args, training: bool = False):
    """The target on the chosen backend; ``training``: a command that needs the torch backend's
    training forwards (train, cache-teacher, eval-offline)."""
    from jetflow.models.loading import load_target

    device, dtype = _device_and_dtype(args)
    backend = args.backend
    if training:
        if backend == "llamacpp":
            raise JetFlowError(f"jetflow {args.command} runs on the torch backend (it needs the target's training "
                               "forwards); drop --backend llamacpp")
        backend = "torch"
    return load_target(args.target, backend=backend, device=device, dtype=dtype, n_threads=args.threads,
                       flash_attn=args.flash_attn == "on")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, streaming it to stdout")
    g.add_argument("prompt", help="the prompt text; '-' reads it from standard input (long prompts, files)")
    _add_target_args(g)
    g.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="apply the chat template (default when the model has one)")
    g.add_argument("--no-chat", dest="chat", action="store_false", help="encode the prompt as raw text")
    _add_decoding_args(g)
    g.add_argument("--check-lossless", action="store_true",
                   help="also decode autoregressively and exit 1 if the outputs differ")
    g.add_argument("--compare", action="store_true",
                   help="also decode autoregressively and print both speeds side by side (exit 1 if texts differ)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="a conversation in the terminal (or from piped lines): each line is a turn, "
                                    "and the next turn starts from the cache")
    _add_target_args(c)
    c.add_argument("--system", default=None, help="a system message opening the conversation")
    _add_decoding_args(c)
    c.set_defaults(func=cmd_chat)

    r = sub.add_parser("regenerate", help="answer training prompts with the target itself (sharded, resumable)")
    _add_target_args(r)
    r.add_argument("--prompts", required=True,
                   help="comma-separated sources: gsm8k-train, math-train, sharegpt, sharegpt-multi, documents, "
                        "or .jsonl files")
    r.add_argument("--num", type=_positive_int, default=None, help="number of prompts (default: all)")
    r.add_argument("--mix", default=None, help="source ratios, e.g. gsm8k-train=0.6,sharegpt=0.4")
    r.add_argument("--max-new-tokens", type=_positive_int, default=256, help="(default: %(default)s)")
    r.add_argument("--batch-size", type=_positive_int, default=32)
    r.add_argument("--shard-size", type=_positive_int, default=256)
    r.add_argument("--answers", choices=["target", "dataset"], default="target",
                   help="target: the target answers each prompt (default); dataset: keep the datasets' own "
                        "answers instead (the raw-data ablation; no generation)")
    r.add_argument("--temperature", type=_number, default=0.0, help="0 = greedy answers (default)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--exclude", type=_data_dir, action="append", default=[], metavar="DIR",
                   help="skip the prompts an earlier regeneration in DIR already answered (repeatable)")
    r.add_argument("--out", required=True, type=Path)
    r.set_defaults(func=cmd_regenerate)

    t = sub.add_parser("train", help="train a draft head on regenerated data (resumable; torchrun for data parallel)")
    _add_target_args(t)
    _add_data_arg(t)
    t.add_argument("--out", required=True, type=Path)
    t.add_argument("--head", choices=["block", "eagle3"], default="block",
                   help="block: the JetFlow/DFlash parallel head (default); eagle3: the autoregressive baseline "
                        "(use --layers 1; --block-size = deepest draft level + 1)")
    t.add_argument("--ttt-steps", type=_non_negative_int, default=0,
                   help="eagle3: training-time-test unroll steps (0: the head's deepest level)")
    t.add_argument("--attention", choices=["causal", "bidirectional"], default="causal")
    t.add_argument("--loss", choices=["fkl", "sft", "rkl"], default="fkl")
    t.add_argument("--kl-temperature", type=_number, default=1.0)
    t.add_argument("--gamma", type=_number, default=0.0, help="depth weighting exp(-(k-1)/gamma); 0 = uniform")
    t.add_argument("--block-size", type=_positive_int, default=16)
    t.add_argument("--anchors-per-seq", type=_positive_int, default=16)
    t.add_argument("--layers", type=_positive_int, default=2, help="decoder layers of the head (default: %(default)s)")
    t.add_argument("--target-layers", default=None, metavar="IDS",
                   help="target layers a new head reads, 0-based, e.g. 1,8,14,20,27 (as `cache-teacher --layers`; "
                        "default: the --teacher-cache's layers, else the draft head's default choice); a head from "
                        "--init-from or --resume keeps its own, and other layers are refused")
    t.add_argument("--lr", type=_number, default=3e-4)
    t.add_argument("--epochs", type=_positive_int, default=1)
    t.add_argument("--batch", type=_positive_int, default=4, help="sequences per step and process")
    t.add_argument("--grad-accum", type=_positive_int, default=1)
    t.add_argument("--warmup", type=_non_negative_int, default=20)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-every", type=_positive_int, default=100)
    t.add_argument("--eval-every", type=_positive_int, default=100)
    t.add_argument("--max-steps", type=_positive_int, default=None, help="stop after this step (resumable)")
    t.add_argument("--max-seconds", type=_number, default=0.0,
                   help="training time budget: stop once this many seconds of training are spent, the "
                        "learning-rate schedule decaying over the budget (for heads compared at equal time; "
                        "0 = off)")
    t.add_argument("--pack-sequences", type=_non_negative_int, default=0,
                   help="sequences per target and head forward, packed end to end (the same losses; 0 = the "
                        "whole micro-batch on a GPU, 1 on the CPU, where packing is slower)")
    t.add_argument("--max-sequences", type=_positive_int, default=None,
                   help="train on the first N sequences of --data in shard order (learning curves over data size; "
                        "with --teacher-cache, N must end on one of its parts)")
    t.add_argument("--resume", action="store_true")
    t.add_argument("--teacher-cache", type=Path, default=None,
                   help="a `jetflow cache-teacher` directory for these data (default: run the target online)")
    t.add_argument("--draft-vocab", type=_non_negative_int, default=0,
                   help="predict only the N most frequent answer tokens (0 = the full vocabulary)")
    t.add_argument("--feed-last-feature", action="store_true",
                   help="add the anchor embedding and the target feature before it to every slot's input")
    t.add_argument("--depth-embedding", action="store_true", help="learned per-depth embedding of the block slots")
    t.add_argument("--dense-depth1", type=_number, default=None, metavar="W",
                   help="causal block heads: add W x the mean depth-1 loss over 2-slot blocks [anchor, MASK] at every "
                        "answer position (default 1 for causal block heads, else 0; 0 = off, the objective "
                        "before it became the default)")
    t.add_argument("--dense-depth1-anchors", type=_non_negative_int, default=0, metavar="N",
                   help="the --dense-depth1 term over N random answer positions per sequence (0 = all of them)")
    t.add_argument("--embed-norm", action="store_true",
                   help="block heads: RMS-normalise the slots' token embeddings before the fused feature is added")
    t.add_argument("--reveal", type=_number, default=0.0, metavar="P",
                   help="causal block heads: in this share of the training blocks the first m slots (m uniform in "
                        "1..B-2) hold the true next tokens instead of MASK, training the head's second, "
                        "path-conditioned pass (`--refine` when decoding; 0 = off)")
    t.add_argument("--slot-token-gain", type=_number, default=1.0, metavar="G",
                   help="block heads: multiply the token embeddings of the slots after the anchor by G (revealed "
                        "path tokens are otherwise a small part of a slot's input; 1 = off)")
    t.add_argument("--shift-tokens", action="store_true",
                   help="causal block heads: each slot reads the token of the slot before it instead of its own "
                        "(so the slot after a revealed path token gets it as input; revealed slots stay supervised)")
    t.add_argument("--path-projection", action="store_true",
                   help="with --shift-tokens: the token a slot reads passes a projection of its own (RMSNorm + "
                        "linear), as an EAGLE head's token input does")
    t.add_argument("--amp", choices=["bfloat16"], default="",
                   help="bf16 autocast of the head's forward/backward (weights, optimizer and losses stay fp32); "
                        "for GPUs: on a 2-core AMX CPU it did not pay (docs/results.md, \"The fourth drafter\")")
    t.add_argument("--init-from", default=None,
                   help="start from this drafter checkpoint (e.g. a run on less data); new optimizer and "
                        "schedule, and a reduced vocabulary chosen again from this run's data; a block head may "
                        "start a run with a smaller --block-size (it keeps its first depth embeddings)")
    t.add_argument("--snapshot-at", default=None,
                   help="keep drafter copies at these fractions of training, e.g. 0.25,0.5 (learning curves)")
    t.set_defaults(func=cmd_train)

    c = sub.add_parser("cache-teacher", help="run the target once over regenerated data and store its features "
                                             "and top-k distributions for training (resumable)")
    _add_target_args(c)
    _add_data_arg(c)
    c.add_argument("--out", required=True, type=Path)
    c.add_argument("--top-k", type=_positive_int, default=32, help="teacher tokens kept per position")
    c.add_argument("--layers", default=None, help="tapped target layers, e.g. 1,8,14,20,27 (default: the "
                                                  "draft head's default choice)")
    c.add_argument("--part-size", type=_positive_int, default=256, help="sequences per cache file")
    c.add_argument("--batch-tokens", type=_positive_int, default=4096, help="tokens per target forward")
    c.add_argument("--max-sequences", type=_positive_int, default=None,
                   help="cache only the first N sequences of --data in shard order (what `train --max-sequences` "
                        "will read)")
    c.set_defaults(func=cmd_cache_teacher)
    ds = sub.add_parser("data-stats", help="what regenerated data holds: answer tokens per prompt source, long "
                                           "answers, backend and tokens/s of each directory")
    _add_data_arg(ds)
    ds.add_argument("--long-answer", type=_positive_int, default=500, help="count answers of at least this many tokens")
    ds.add_argument("--drafter", action="append", default=[], metavar="DIR",
                    help="also count the share of answer tokens inside this drafter's draft vocabulary (repeat)")
    ds.add_argument("--json", action="store_true", help="print the numbers as JSON")
    ds.set_defaults(func=cmd_data_stats)
    o = sub.add_parser("eval-offline", help="greedy tau of block heads vs budget on held-out regenerated "
                                            "sequences, decoding replayed without the target (for ablations)")
    _add_offline_eval_args(o, "block-head checkpoint (repeat to compare)")
    o.add_argument("--budgets", default="16,32,64,128,256")
    o.add_argument("--width", type=_positive_int, default=7)
    o.add_argument("--anchors-per-seq", type=_non_negative_int, default=0,
                   help="0: rounds where greedy decoding puts them (reproduces decoding's tau; default); "
                        "N: N random answer anchors per sequence, shared by all budgets")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--no-refine", action="store_true",
                   help="replay only the first head pass of heads trained for the path-conditioned second pass")
    o.add_argument("--refine-passes", type=_replay_passes, default=None, metavar="N|tree[:N]",
                   help="replay N path-conditioned passes, each on the path the one before chose (default: 1 for "
                        "heads trained for it); 'tree': the pass conditioning every node of the round's first "
                        "tree, 'tree:N' N of them (as `jetflow bench --refine`)")
    o.add_argument("--lookup", action="store_true",
                   help="trees merged with the prompt-lookup chain, as the default decoder builds them "
                        "(rounds where decoding puts them); the lookup calibration starts fresh per sequence")
    o.add_argument("--lookup-session", action="store_true",
                   help="as --lookup, the lookup calibration's counts carried from one sequence to the next, "
                        "as when one JetFlow object (a Python session, `jetflow bench`) answers them in order")
    o.add_argument("--no-calibration", action="store_true",
                   help="rank tree nodes by draft log-prob even for heads with a tree calibration (`jetflow calibrate`)")
    o.add_argument("--out", type=Path, default=None,
                   help="write the JSON report here; until it is written, finished sequences are kept in "
                        "OUT.partial.jsonl, and the same command run again resumes from them")
    o.set_defaults(func=cmd_eval_offline)
    w = sub.add_parser("draft-vocab", help="grow a trained head's draft vocabulary (same weights; the most "
                                           "frequent answer tokens of its training data are added)")
    _add_target_args(w)
    w.add_argument("--drafter", required=True, help="reduced-vocabulary head checkpoint directory")
    w.add_argument("--data", action="append", required=True, metavar="DIR",
                   help="the regenerated data the head was trained on (repeat, in training order)")
    w.add_argument("--seed", type=int, default=0, help="the training run's --seed (its held-out split is not counted)")
    w.add_argument("--max-sequences", type=_positive_int, default=None,
                   help="the training run's --max-sequences (only its training split is counted)")
    w.add_argument("--size", type=_non_negative_int, required=True,
                   help="new number of draft ids (0: the whole target vocabulary)")
    w.add_argument("--out", required=True, help="directory for the widened head (then `jetflow calibrate` it)")
    _add_overwrite_arg(w)
    w.set_defaults(func=cmd_draft_vocab)
    k = sub.add_parser("calibrate", help="fit a block head's tree calibration (draft log-prob -> acceptance "
                                         "log-prob, per depth) on held-out regenerated sequences")
    _add_target_args(k)
    k.add_argument("--drafter", required=True, help="block-head checkpoint directory")
    _add_data_arg(k)
    k.add_argument("--teacher-cache", type=Path, default=None,
                   help="a `jetflow cache-teacher` directory for --data (default: run the target online)")
    k.add_argument("--held-out", action="store_true",
                   help="the sequences `jetflow train` held out from this --data (same --seed)")
    k.add_argument("--seed", type=int, default=0, help="the training run's --seed (with --held-out)")
    k.add_argument("--max-sequences", type=_positive_int, default=None,
                   help="the training run's --max-sequences (with --held-out: the split is drawn from that many)")
    k.add_argument("--sequences", type=_sequence_range, default=None,
                   help="START:END range of sequences the head was not trained on")
    k.add_argument("--width", type=_positive_int, default=7, help="candidates per depth (decoding's --width)")
    k.add_argument("--out", type=Path, default=None,
                   help="write the calibrated checkpoint here (default: replace --drafter's config.json in place; "
                        "the weights are copied untouched)")
    k.add_argument("--report", type=Path, default=None, help="write the fit (curves, sequences) as JSON here")
    _add_overwrite_arg(k)
    k.set_defaults(func=cmd_calibrate)
    a = sub.add_parser("eval-agreement", help="per-depth top-1 agreement of block or EAGLE heads with the target at "
                                              "every answer position of held-out regenerated sequences")
    _add_offline_eval_args(a, "drafter checkpoint, block or eagle3 (repeat)")
    a.add_argument("--max-depth", type=_positive_int, default=4)
    a.add_argument("--path-conditioned", action="store_true",
                   help="block heads: depth k drafted after the true tokens of depths 1..k-1 (revealed blocks, the "
                        "second pass's layout), as an EAGLE head's depth k is")
    a.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    a.set_defaults(func=cmd_eval_agreement)
    b = sub.add_parser("bench", help="benchmark decoding methods over evaluation sets and budgets "
                                     "(JSON per run, Markdown summary, plots; resumable)")
    _add_target_args(b)
    b.add_argument("--drafter", default="auto", help="causal (JetFlow) head for jetflow/jetflow-chain "
                                                    "(default: the shipped one)")
    b.add_argument("--baseline-drafter", default=None, help="bidirectional head for dflash/ddtree")
    b.add_argument("--eagle-drafter", default=None, help="EAGLE-3-style head (`jetflow train --head eagle3`) "
                                                         "for the eagle3 method")
    b.add_argument("--native-drafter", default="auto",
                   help="DFlash-compatible causal head that llama-dflash exports to GGUF and runs in llama.cpp's own "
                        "speculative driver (default: the shipped <target>-dflash head)")
    b.add_argument("--datasets", default="gsm8k",
                   help="comma list of gsm8k, math500, aime, humaneval, mtbench, and .jsonl files of your own prompts "
                        "(fields prompt / question / problem / turns / messages, optional id, category and chat)")
    b.add_argument("--limit", type=_positive_int, default=None, help="first N prompts of each dataset")
    b.add_argument("--methods", default="ar,jetflow-lookup",
                   help="comma list of ar, llama-ar, hf, pld, lookup, dflash, ddtree, jetflow, jetflow-chain, jetflow-lookup, "
                        "jetflow-refine, eagle3, eagle3-lookup, torch-ar, torch-jetflow, llama-dflash (the reference -- ar, "
                        "or llama-ar in a greedy run on llama.cpp -- is always run; default: %(default)s, what `jetflow generate` "
                        "decodes with, against plain decoding)")
    b.add_argument("--budgets", default="auto",
                   help="draft nodes per round for the tree methods, comma-separated, or auto (default: %(default)s, "
                        "as `jetflow generate` on a CPU)")
    b.add_argument("--width", type=_positive_int, default=7, help="candidates per depth (default: %(default)s)")
    b.add_argument("--refine", type=_refine_mode, default=1, metavar="N|tree[:N]",
                   help="the second pass of jetflow-refine (and of jetflow-lookup with a head trained for it): N "
                        "path-conditioned passes per round, each on the path the one before chose, or 'tree': one "
                        "pass conditioning every node of the first pass's tree ('tree:N': N, each over the tree "
                        "the one before built; default 1)")
    _add_draft_weights_arg(b)
    b.add_argument("--temperature", type=_number, default=0.0, help="0 = greedy (as is anything below 1e-5): every output must equal the reference's "
                        "(ar, or llama-ar on llama.cpp); above, a sampled run measured against ar")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--max-new-tokens", type=_positive_int, default=256, help="(default: %(default)s)")
    b.add_argument("--repeats", type=_positive_int, default=1, help="timed runs per prompt (median kept)")
    b.add_argument("--order", choices=["interleaved", "sequential"], default="interleaved",
                   help="interleaved (default): each prompt goes through every method before the next, the "
                        "order rotating, so a drift in machine speed falls on all methods alike (a dataset's "
                        "runs are saved when it ends); sequential: one run after another, each saved as it ends")
    b.add_argument("--no-cost-model", action="store_true", help="skip measuring the verify/draft cost curve")
    b.add_argument("--out", required=True, type=Path)
    b.add_argument("--overwrite", action="store_true",
                   help="replace runs stored in --out with other settings (default: refuse, naming them)")
    b.set_defaults(func=cmd_bench)
    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (streaming, metrics, adaptive budget)")
    _add_target_args(v)
    v.add_argument("--drafter", default="auto", help="draft head dir, 'auto' (shipped one) or 'none'")
    v.add_argument("--budget", type=_budget, default="auto",
                   help="draft nodes per round, or 'auto' (default): chosen every round from this machine's cost "
                        "curve and the acceptance seen so far")
    v.add_argument("--width", type=_positive_int, default=7, help="candidates per depth (default: %(default)s)")
    v.add_argument("--no-lookup", action="store_true",
                   help="draft from the head alone (default: prompt-lookup candidates join the head's tree)")
    _add_draft_weights_arg(v)
    _add_auto_state_arg(v, "; kept with --max-batch 1 only (a batch's shared policy starts from nothing)")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=_port, default=8000)
    v.add_argument("--max-batch", type=_positive_int, default=32,
                   help="requests decoded together, continuously batched: each step verifies all their drafts in "
                        "one forward (1 = one request at a time); on llama.cpp each request holds a KV stream of the "
                        "model's context length")
    v.add_argument("--prefix-cache", choices=["on", "off"], default="on",
                   help="start a prompt from the cached KV of the prefix it shares with an earlier one (a chat's next "
                        "turn, a system prompt): on either backend, one request at a time or batched. off: "
                        "every prompt is prefilled in full, so no client's timing tells what others sent (default: on)")
    v.add_argument("--prefix-cache-slots", type=_non_negative_int, default=4,
                   help="with --max-batch > 1: recent prompts and finished conversations kept for the prefix cache "
                        "(llama.cpp: each in a KV stream of the model's context length; torch: their keys and values "
                        "copied out); 0: none, and no copies or kept features (default: %(default)s)")
    v.add_argument("--max-prefill-tokens", type=_positive_int, default=256,
                   help="prompt tokens prefilled between two decoding steps of a batch (at least one request): "
                        "requests arriving together are admitted over several steps, so running ones keep "
                        "streaming and the first of the newcomers start sooner")
    v.add_argument("--max-queue", type=_positive_int, default=16,
                   help="requests allowed to wait for the generation worker; more get 429 + Retry-After")
    v.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ (or set "
                                                    "JETFLOW_API_KEY)")
    v.add_argument("--model-name", default=None, help="the model id clients send (default: the target's name)")
    v.add_argument("--max-body-bytes", type=_positive_int, default=1 << 20)
    v.add_argument("--shutdown-timeout", type=_non_negative_float, default=30.0,
                   help="seconds to let open requests finish after SIGTERM before cancelling them")
    v.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    v.set_defaults(func=cmd_serve)
    x = sub.add_parser("export-vllm", help="write a block head in vLLM's DFlash format (chain mode in vLLM)")
    x.add_argument("--drafter", required=True, help="a JetFlow block-head checkpoint directory")
    x.add_argument("--target", default=None, help="the head's target (default: the one its config names); "
                                                  "read only for a reduced vocabulary, to copy its LM-head rows")
    x.add_argument("--out", required=True, type=Path)
    _add_overwrite_arg(x)
    x.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    x.set_defaults(func=cmd_export_vllm)
    g = sub.add_parser("export-gguf", help="write a block head as a DFlash GGUF that llama.cpp's speculative driver runs")
    g.add_argument("--drafter", required=True, help="a JetFlow block-head checkpoint directory")
    g.add_argument("--target", default=None, help="the target's GGUF file or known model name (default: the one the "
                                                  "head's config names); its tokenizer is copied into the draft")
    g.add_argument("--out", required=True, type=Path, help="the .gguf file to write")
    g.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    g.add_argument("--overwrite", action="store_true", help="replace an existing --out file (default: refused)")
    g.set_defaults(func=cmd_export_gguf)
    return parser


# Options that name files or directories: a leading ~ is the home directory, as in a shell, also
# where the shell leaves it alone (`--out=~/runs/x`, a quoted path in a script), never a directory "~".
# (--exclude is expanded by its own type, _data_dir, which checks the directory while parsing)
PATH_OPTIONS = ("out", "data", "drafter", "prompts", "init_from", "teacher_cache", "report", "auto_state",
                "baseline_drafter", "eagle_drafter", "native_drafter")


def _expand_home(args) -> None:
    def expand(value):
        if isinstance(value, list):
            return [expand(v) for v in value]
        if isinstance(value, (str, Path)) and str(value).startswith("~"):
            return type(value)(os.path.expanduser(str(value)))
        return value

    for name in PATH_OPTIONS:
        if hasattr(args, name):
            setattr(args, name, expand(getattr(args, name)))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _expand_home(args)
    if getattr(args, "flash_attn", "off") == "on" and getattr(args, "backend", "auto") != "torch":
        print("jetflow: note: --flash-attn on: llama.cpp's fused attention sums in other orders for one row and "
              "for many, so outputs are no longer guaranteed identical to one-token decoding (README, Backends)",
              file=sys.stderr)
    try:
        return args.func(args)
    except JetFlowError as e:
        print(f"jetflow: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
