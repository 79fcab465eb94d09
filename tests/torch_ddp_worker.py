"""A tiny transformer language model built either from torch's norms/softmax or
from numba_fused.torch's, and a DistributedDataParallel worker (gloo, CPU).

Imported by tests/test_torch.py for the model; run as a script (one process per
rank) by its DDP test:

    python tests/torch_ddp_worker.py RANK WORLD PORT OUT_DIR
"""
import math
import os
import sys

import torch
from torch import nn

VOCAB, DIM, HEADS, SEQ, BATCH = 64, 32, 2, 16, 8


class TinyLM(nn.Module):
    """Embedding -> [RMSNorm -> causal attention (softmax)] -> [LayerNorm -> MLP]
    -> LayerNorm -> logits. ``impl``: "torch" or "nf" (numba_fused.torch); the two
    have the same parameter names, so their state_dicts are interchangeable."""

    def __init__(self, impl="torch", vocab=VOCAB, dim=DIM, heads=HEADS):
        super().__init__()
        if impl == "torch":
            rms, ln, self.softmax = nn.RMSNorm, nn.LayerNorm, torch.softmax
        else:
            import numba_fused.torch as nft
            rms, ln, self.softmax = nft.RMSNorm, nft.LayerNorm, nft.softmax
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.norm1 = rms(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = ln(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.norm_f = ln(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        b, t = tokens.shape
        h = self.emb(tokens)
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).triu(1)
        attn = self.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        h = h + self.proj((attn @ v).transpose(1, 2).reshape(b, t, -1))
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(h))))
        return self.head(self.norm_f(h))

    def loss(self, tokens):
        logits = self.forward(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           tokens[:, 1:].reshape(-1))


def make_model(impl, seed=0):
    torch.manual_seed(seed)
    return TinyLM(impl)


def make_batch(step, batch=BATCH, seq=SEQ + 1, vocab=VOCAB):
    """Token rows counting up by 1 or 2 from a random start (mod vocab), with a
    little noise: learnable within a few steps."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 3, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(seq)) % vocab
    noise = torch.rand(batch, seq, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, vocab, (batch, seq), generator=g), tokens)


def grads_after(model, batches, lr=0.05):
    """Gradients of each step's loss, with an SGD step after each (so later
    steps see the earlier updates). Returns a list of {name: grad}."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for tokens in batches:
        opt.zero_grad()
        model.loss(tokens).backward()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
    return out


STEPS = 2


def main(rank, world, port, out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model = DDP(make_model("nf"))
        per = BATCH // world
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        out = []
        for step in range(STEPS):
            tokens = make_batch(step)[rank * per:(rank + 1) * per]
            opt.zero_grad()
            _ddp_loss(model, tokens).backward()
            out.append({n: p.grad.detach().clone()
                        for n, p in model.module.named_parameters()})
            opt.step()
        torch.save(out, os.path.join(out_dir, f"grads{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _ddp_loss(ddp_model, tokens):
    """The loss through the DDP wrapper's forward (so its hooks see the graph)."""
    logits = ddp_model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       tokens[:, 1:].reshape(-1))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
