"""A batched PyTorch handler for ``--handler``: one model per GPU process.

Run it with one inference process per card::

    PYTHONPATH=examples python -m node run --handler gpu_handler:Embedder --gpus 0,1

Each inference process sees only its own card (``CUDA_VISIBLE_DEVICES``), so
``setup`` is called with ``"cuda:0"`` in every one of them, or with ``"cpu"``
when the node runs ``--inference-procs N`` without GPUs (the same code runs
there, slowly, which is handy on a laptop).

What it does: embeds ``payload["text"]`` with a small bag-of-hashed-tokens
model (``TinyEmbedder``, random weights from a fixed seed, nothing to
download) and answers ``{"dim": 256, "embedding": [...]}`` per item. Replace
``_build_model`` with your own (``torch.load`` of a checkpoint on local disk,
a ``transformers`` model from a local directory, ...); the batching around it
stays the same.

The pattern, which is what matters:

- ``torch`` is imported in ``setup``, not at module level: the node loads the
  handler's module to check it, and only the inference processes need CUDA.
- ``setup`` loads the model once, moves it to the device, switches it to
  ``eval()``, and runs one warm-up batch so the first real batch does not pay
  for CUDA kernel selection inside ``handler_timeout_s``.
- ``__call__`` validates each item first: a bad item gets an exception
  instance as its result (that item alone is released with the error); the
  good ones are stacked into one padded tensor and run in one forward pass
  under ``torch.inference_mode()`` (and autocast on CUDA), then copied back
  to the CPU in one transfer and split per item.
- An exception raised by ``__call__`` (CUDA out of memory, say) fails the
  whole batch: its leases are released with the error and come back after a
  hold, each in a batch of its own, so one bad item cannot keep failing its
  neighbours.
- Results must be JSON values or bytes. For big vectors, bytes are smaller:
  ``return tensor.numpy().astype("<f2").tobytes()``.

Not run by the tests (torch is not a dependency of the node).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

# Model shape. Small on purpose: the example is about batching, not the model.
DIM = 256
BUCKETS = 1 << 16  # hashed token ids
MAX_TOKENS = 512  # longer texts are cut
# Weights from a checkpoint on local disk when set (a state_dict saved with
# torch.save(model.state_dict(), path)); random weights from SEED otherwise.
WEIGHTS_ENV = "GPU_HANDLER_WEIGHTS"
SEED = 1234


def tokens(text: str) -> list[int]:
    """Hashed token ids of a text (stable across processes and hosts)."""
    out = []
    for word in text.lower().split()[:MAX_TOKENS]:
        digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little") % BUCKETS)
    return out


def _build_model(torch: Any) -> Any:
    nn = torch.nn

    class TinyEmbedder(nn.Module):
        """Mean of token embeddings, a projection, L2-normalised."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(BUCKETS, DIM, padding_idx=0)
            self.proj = nn.Linear(DIM, DIM)

        def forward(self, ids: Any, mask: Any) -> Any:
            vectors = self.embed(ids) * mask.unsqueeze(-1)
            mean = vectors.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
            return torch.nn.functional.normalize(self.proj(mean), dim=-1)

    torch.manual_seed(SEED)
    model = TinyEmbedder()
    weights = os.environ.get(WEIGHTS_ENV)
    if weights:
        model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    return model


class Embedder:
    """``--handler gpu_handler:Embedder``: set up once per process, then
    called with one batch of items at a time."""

    def setup(self, device: str) -> None:
        import torch  # lazily: only inference processes need it

        self.torch = torch
        self.device = torch.device(device)
        self.model = _build_model(torch).to(self.device).eval()
        if self.device.type == "cuda":
            # Let cuDNN/cuBLAS pick kernels now, not on the first real batch.
            torch.backends.cudnn.benchmark = True
        self._forward([[1, 2, 3]] * 4)  # warm-up

    def __call__(self, items: list[dict[str, Any]]) -> list[Any]:
        results: list[Any] = [None] * len(items)
        batch: list[list[int]] = []
        where: list[int] = []
        for i, item in enumerate(items):
            payload = item.get("payload")
            text = payload.get("text") if isinstance(payload, dict) else None
            if not isinstance(text, str) or not text.strip():
                # This item alone fails; the rest of the batch goes on.
                results[i] = ValueError("payload needs a non-empty 'text'")
                continue
            batch.append(tokens(text) or [0])
            where.append(i)
        if batch:
            vectors = self._forward(batch)
            for i, vector in zip(where, vectors, strict=True):
                results[i] = {"dim": DIM, "embedding": [round(x, 6) for x in vector]}
        return results

    def _forward(self, batch: list[list[int]]) -> list[list[float]]:
        torch = self.torch
        width = max(len(ids) for ids in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.float32)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1.0
        # pin_memory + non_blocking: the copy overlaps with the launch.
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            ids, mask = ids.pin_memory(), mask.pin_memory()
        ids = ids.to(self.device, non_blocking=True)
        mask = mask.to(self.device, non_blocking=True)
        with torch.inference_mode():
            if on_cuda:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = self.model(ids, mask)
            else:
                out = self.model(ids, mask)
        # One device-to-host copy for the whole batch (it also synchronises).
        return out.float().cpu().tolist()
