"""`kvshare admin publish`: compute a public prefix's KV blocks and publish them.

    kvshare admin publish --target HOST:PORT --token-file F [--keyring K] \\
        (--tokens-file ids.json | --text-file prompt.txt) [--model demo | HF_PATH]

Runs the model over the token sequence (a transformers model: the demo's random-weight
Llama by default, or a local Hugging Face checkpoint whose tokenizer reads
`--text-file`), stores its full blocks in the public scope `@public` on the plain
chain (sealed under the public data key when a keyring is given), and adds their
digests to the scope's catalogue (replica_agent.public), from which every reading
engine learns the prefix. The token needs the `publish` action. Blocks already
published are not computed again. Prints what it did as one JSON line.

Needs the agent extra (torch, transformers); the import is deferred so that `kvshare
admin` works on a server-only install.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcommon.errors import ConfigError
from kvshare.client_options import read_token_file

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from replica_agent.agent import ReplicaAgent
    from replica_agent.spec import ModelSpec


def add_publish_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, metavar="HOST:PORT")
    parser.add_argument("--token-file", required=True, type=Path, metavar="F")
    parser.add_argument(
        "--keyring", type=Path, metavar="K", help="seal under its public key (--public)"
    )
    parser.add_argument("--tls-ca", type=Path, metavar="F", help="the server's CA (TLS)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens-file", type=Path, metavar="F", help="a JSON list of token ids")
    source.add_argument("--text-file", type=Path, metavar="F", help="text for the tokenizer")
    parser.add_argument(
        "--model",
        default="demo",
        help="`demo` (the demo's random-weight Llama) or a local transformers checkpoint",
    )
    parser.add_argument("--block-tokens", type=int, default=32, metavar="N")


def run_publish(args: argparse.Namespace) -> dict[str, Any]:
    """Publish; print a JSON line; return the audit fields (no tokens, no digests)."""
    from policy.sealing import BlockSealer, Keyring
    from policy.types import PUBLIC
    from replica_agent.agent import ReplicaAgent
    from replica_agent.client import ClientTls

    model, spec, token_ids = _load(args)
    sealer = None
    if args.keyring is not None:
        keyring = Keyring.from_file(args.keyring)
        if PUBLIC not in keyring.tenants():
            raise ConfigError(
                f"{args.keyring} has no key for the public scope; add one with "
                "`kvshare admin keyring --public`"
            )
        sealer = BlockSealer(keyring)
    token = read_token_file(args.token_file)
    tls = ClientTls(root_ca=args.tls_ca) if args.tls_ca else None
    agent = ReplicaAgent.connect(args.target, token, spec, tls=tls, sealer=sealer)
    try:
        report = publish_prefix(agent, model, token_ids)
    finally:
        agent.close()
    print(json.dumps(report))
    return {"action": "publish", "blocks": report["blocks"], "new_blocks": report["new_blocks"]}


def publish_prefix(
    agent: ReplicaAgent, model: PreTrainedModel, token_ids: list[int]
) -> dict[str, Any]:
    """Publish `token_ids`' full blocks through `agent` (whose principal has `publish`),
    computing only those not yet published, and list them in the catalogue. Raises
    ConfigError saying what to change when the store refuses."""
    from policy.types import PUBLIC
    from replica_agent.public import write_catalogue

    spec = agent.spec
    digests = agent.digests(token_ids)
    if not digests:
        raise ConfigError(
            f"{len(token_ids)} tokens make no full block of {spec.block_tokens}; "
            "publish a longer prefix or pass a smaller --block-tokens"
        )
    present = _checked(lambda: agent.client.lookup(PUBLIC, agent.model, digests))
    if present < len(digests):
        blocks = _compute(model, spec, token_ids, present, len(digests) - present)
        agent.save(PUBLIC, digests[present:], blocks)
        agent.flush()
    stored = _checked(lambda: agent.client.lookup(PUBLIC, agent.model, digests))
    if stored < len(digests):
        why = (
            "the store refused them: give this principal the publish action "
            "(kvshare admin token --actions publish), or raise [public] quota_bytes"
            if agent.stats.refused_calls
            else "check that the store is reachable and its [public] quota_bytes"
        )
        raise ConfigError(f"the store kept {stored} of {len(digests)} blocks; {why}")
    listed = _checked(
        lambda: write_catalogue(agent.client, agent.model, digests, sealer=agent.sealer)
    )
    return {
        "model": agent.model,
        "blocks": len(digests),
        "new_blocks": len(digests) - present,
        "tokens": len(digests) * spec.block_tokens,
        "catalogue_blocks": listed,
    }


def _checked(call: Any) -> Any:
    """The call's result; a store refusal becomes a ConfigError saying what to change."""
    import grpc

    from replica_agent.public import CatalogueFull

    try:
        return call()
    except CatalogueFull as error:
        raise ConfigError(str(error)) from None
    except grpc.RpcError as error:
        raise ConfigError(_refusal(error.code(), error.details())) from None
    except Exception as error:
        code = getattr(error, "code", None)
        status = code() if callable(code) else code
        if isinstance(status, grpc.StatusCode):
            raise ConfigError(_refusal(status, str(error))) from None
        raise


def _refusal(status: Any, details: str | None) -> str:
    import grpc

    if status == grpc.StatusCode.PERMISSION_DENIED:
        return (
            "the store refused the public scope: give this principal the publish action "
            "(kvshare admin token --actions publish), and the server a [public] table"
        )
    if status == grpc.StatusCode.UNAUTHENTICATED:
        return "the store did not accept the token; check --token-file"
    return f"the store answered {status.name}: {details}"


def _load(args: argparse.Namespace) -> tuple[PreTrainedModel, ModelSpec, list[int]]:
    from replica_agent.adapters.hf import spec_for

    if args.block_tokens < 1:
        raise ConfigError("--block-tokens must be at least 1")
    model: PreTrainedModel
    if args.model == "demo":
        from kvshare.demo.replica import ReplicaSettings, demo_model

        model, spec = demo_model(ReplicaSettings(block_tokens=args.block_tokens))
        tokenizer_path = None
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
        spec = spec_for(
            model, model_id=args.model, revision="local", block_tokens=args.block_tokens
        )
        tokenizer_path = args.model
    return model, spec, _token_ids(args, tokenizer_path)


def _token_ids(args: argparse.Namespace, tokenizer_path: str | None) -> list[int]:
    if args.tokens_file is not None:
        try:
            ids = json.loads(args.tokens_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ConfigError(f"cannot read token ids from {args.tokens_file}: {error}") from None
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            raise ConfigError(f"{args.tokens_file} must hold a JSON list of token ids")
        return ids
    if tokenizer_path is None:
        raise ConfigError("the demo model has no tokenizer; pass --tokens-file")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    text = args.text_file.read_text(encoding="utf-8")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _compute(
    model: PreTrainedModel, spec: ModelSpec, token_ids: list[int], first: int, count: int
) -> list[Any]:
    import torch

    from replica_agent.adapters.hf import blocks_from_cache, prefill

    end = (first + count) * spec.block_tokens
    with torch.inference_mode():
        _, cache = prefill(model, token_ids[:end])
    return blocks_from_cache(cache, spec, first, count)
