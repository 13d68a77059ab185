"""Context-parallel training with flexmask shards on torch.distributed (gloo on CPU).

Run:  torchrun --nproc-per-node 2 examples/context_parallel.py [--steps 3] [--seq 1024]

Each rank builds only its own BlockMask shard (no collective), keeps its queries, all-gathers
keys and values (torch's flex_cp_allgather; its backward reduce-scatters), and attends through
flexmask's block-sparse path. A few steps on packed documents (per-document head-tail) and on
a tree pack (mask-aware balancer); every rank also runs the single-process model and checks
that loss and gradients are equal.
"""

from __future__ import annotations

import argparse
import gc
import random
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

import flexmask
from flexmask.context_parallel import PerDocumentBalancer

VOCAB, DIM, HEADS = 64, 32, 2


class TinyAttentionLM(nn.Module):
    """Embedding, one attention layer (attention supplied by the caller), LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: Tensor, attend) -> Tensor:
        x = self.embed(tokens)
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        attn = attend(q, k, v).transpose(1, 2).reshape(batch, length, DIM)
        return self.head(x + self.out(attn))


def step_loss(model: TinyAttentionLM, tokens: Tensor, labels: Tensor, attend, count: int):
    logits = model(tokens, attend)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count


def run(name: str, mask: flexmask.Mask, balancer, seq: int, steps: int, mesh) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference, model = TinyAttentionLM(), TinyAttentionLM()
    model.load_state_dict(reference.state_dict())
    shard = flexmask.shard(mask, 1, HEADS, seq, mesh=mesh, balancer=balancer, BLOCK_SIZE=64)
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(step))
        labels = torch.roll(tokens, -1, dims=1)
        # single process: the whole sequence
        full = step_loss(
            reference,
            tokens,
            labels,
            lambda q, k, v: flexmask.flex_attention(q, k, v, block_mask=mask, compile=False),
            seq,
        )
        full.backward()
        # context parallel: this rank's tokens, every rank's keys and values
        local = step_loss(
            model,
            shard.shard_tensor(tokens, 1),
            shard.shard_tensor(labels, 1),
            lambda q, k, v: flexmask.cp_flex_attention(q, k, v, shard, mesh, compile=False),
            seq,
        )
        local.backward()
        loss = local.detach().clone()
        dist.all_reduce(loss)
        worst = 0.0
        for p, p_ref in zip(model.parameters(), reference.parameters(), strict=False):
            dist.all_reduce(p.grad)  # replicated weights: sum the ranks' shares
            worst = max(worst, float((p.grad - p_ref.grad).abs().max()))
        torch.testing.assert_close(loss, full.detach(), atol=1e-5, rtol=1e-5)
        if rank == 0:
            print(
                f"{name:>9} step {step}: loss CP {loss.item():.6f} single {full.item():.6f} "
                f"max |grad diff| {worst:.1e}"
            )
        assert worst < 1e-5, worst
        for m in (model, reference):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    del world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    # A rank that raises (flexmask checks its inputs before each all-gather) leaves the others
    # waiting in the collective: a short timeout ends them too (gloo's default is 30 min).
    dist.init_process_group("gloo", timeout=timedelta(minutes=2))
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rng = random.Random(0)
    unit = 2 * world
    cuts = sorted(rng.sample(range(1, args.seq // unit), 5))
    lengths = [(b - a) * unit for a, b in zip([0, *cuts], [*cuts, args.seq // unit], strict=False)]
    documents = flexmask.causal() & flexmask.document(lengths)
    run("documents", documents, PerDocumentBalancer([lengths], world), args.seq, args.steps, mesh)
    parents = [-1] + [rng.randrange(max(0, i - 64), i) for i in range(1, args.seq)]
    run("tree", flexmask.tree(parents), "mask_aware", args.seq, args.steps, mesh)
    dist.destroy_process_group()
    # Free the process group now, not while the interpreter shuts down: torch's gloo threads
    # may still release a collective's tensors then, which aborts the rank (pytorch#190489).
    gc.collect()


if __name__ == "__main__":
    main()
