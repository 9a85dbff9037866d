"""Data preparation and the training streams end to end on a local Ray cluster (one per
module)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylm.cli import main
from raylm.config import load_config
from raylm.data.corpus import DROP_REASONS
from raylm.data.preparation import prepare
from raylm.data.streams import PackedSplit, build_train_stream, read_val_blocks
from tests.conftest import PIECE_MB, make_docs, write_jsonl, write_pieces_corpus

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Four files of four formats, with duplicates and every kind of bad record."""
    root = tmp_path_factory.mktemp("corpus")
    docs = make_docs(120)
    write_jsonl(root / "a.jsonl", docs[:40])
    with open(root / "a.jsonl", "ab") as f:
        f.write(b'{"text": broken\n{"other": 1}\n{"text": "\xff\xfe"}\n')
        f.write((json.dumps({"text": docs[0]}) + "\n").encode())  # duplicate of line 1
    (root / "b.txt").write_text("\n\n".join(docs[40:70]) + "\n")
    pq.write_table(pa.table({"text": docs[70:100] + [None, "   "]}), root / "c.parquet")
    (root / "d.md").write_text("\n\n".join(docs[100:120]) + "\n")
    (root / "empty.txt").write_text("")
    return root


def config(corpus, tokenizer_dir, tmp_path, *extra):
    return load_config(None, [f"--data.source={corpus}", f"--tokenizer.path={tokenizer_dir}",
                              "--data.seq_len=31", "--data.rows_per_row_group=16",
                              "--data.val_fraction=0.1", f"--run.cache_dir={tmp_path}/cache",
                              *extra])


def test_prepare_counts_add_up_and_blocks_are_the_token_stream(corpus, tokenizer_dir, tmp_path):
    cfg = config(corpus, tokenizer_dir, tmp_path)
    m = prepare(cfg, tmp_path / "out", log=lambda s: None)
    assert set(m) == {"documents_read", "documents_kept", "dropped", "bad_records", "tokens",
                      "block_length", "blocks", "tail_tokens_dropped", "pieces",
                      "tokenizer_path", "fingerprint", "data_identity"}
    assert m["data_identity"] == m["fingerprint"]  # a text corpus's blocks keep no rows
    assert m["pieces"] == 1
    assert set(m["dropped"]) == set(DROP_REASONS)
    # 41 + 3 JSONL lines, 30 paragraphs, 32 Parquet rows, 20 paragraphs, 1 empty file.
    assert m["documents_read"] == 44 + 30 + 32 + 20 + 1
    assert m["documents_kept"] == 120
    assert m["dropped"] == {"malformed": 1, "missing_field": 2, "empty": 2, "duplicate": 1,
                            "undecodable": 1, "too_short": 0, "too_long": 0}
    assert m["documents_read"] == m["documents_kept"] + sum(m["dropped"].values())
    assert m["tokens"] == m["blocks"] * m["block_length"] + m["tail_tokens_dropped"]
    assert sorted((b["file"].rsplit("/", 1)[1], b["line"], b["reason"])
                  for b in m["bad_records"]) == [
        ("a.jsonl", 41, "malformed"), ("a.jsonl", 42, "missing_field"),
        ("a.jsonl", 43, "undecodable"), ("c.parquet", 31, "missing_field"),
        ("empty.txt", 0, "empty")]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == m

    # The blocks are exactly the tokenized kept documents, each + EOS, in order, no padding.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    train = pq.read_table(tmp_path / "out" / "train").column("input_ids").to_pylist()
    val = pq.read_table(tmp_path / "out" / "val").column("input_ids").to_pylist()
    assert len(train) + len(val) == m["blocks"] and len(val) > 0
    assert all(len(b) == 32 for b in train + val)
    text = tok.decode([t for b in train + val for t in b])
    assert text.count(tok.eos_token) >= m["documents_kept"] - 2  # at most one tail per split
    for doc in make_docs(120)[:30]:
        assert doc in text or doc[:60] in text or doc[-60:] in text


def test_prepare_is_deterministic(corpus, tokenizer_dir, tmp_path):
    cfg = config(corpus, tokenizer_dir, tmp_path, "--data.tokenize_batch_size=7")
    a = prepare(cfg, tmp_path / "a", log=lambda s: None)
    b = prepare(cfg, tmp_path / "b", log=lambda s: None)
    assert a == b
    assert pq.read_table(tmp_path / "a" / "train").equals(pq.read_table(tmp_path / "b" / "train"))


def test_pieces_deduplicate_against_the_whole_corpus_and_pack_on_their_own(
        tokenizer_dir, tmp_path):
    """Six files, each a preparation piece: a duplicate is dropped wherever its first
    occurrence is (same file, an earlier piece), the first occurrence is the one kept (the
    piece of copies writes nothing), and each piece packs its own documents; their tails are
    packed on in a last piece, so the corpus drops what one sequential packing drops."""
    want = write_pieces_corpus(tmp_path / "corpus")
    one = prepare(config(tmp_path / "corpus", tokenizer_dir, tmp_path), tmp_path / "one",
                  log=lambda s: None)
    many = prepare(config(tmp_path / "corpus", tokenizer_dir, tmp_path,
                          f"--data.piece_mb={PIECE_MB}"), tmp_path / "many",
                   log=lambda s: None)
    assert (one["pieces"], many["pieces"]) == (1, 6)
    for m in (one, many):
        assert m["documents_read"] == want["read"] and m["documents_kept"] == want["kept"]
        assert m["dropped"]["duplicate"] == want["duplicate"]
        assert m["documents_read"] == m["documents_kept"] + sum(m["dropped"].values())
        assert m["tokens"] == m["blocks"] * m["block_length"] + m["tail_tokens_dropped"]
    # The same documents in each split: the same tokens, blocks and dropped tail.
    for key in ("tokens", "blocks", "tail_tokens_dropped"):
        assert many[key] == one[key], key
    layout = json.loads((tmp_path / "many" / "layout.json").read_text())
    files = layout["splits"]["train"]["files"] + layout["splits"]["val"]["files"]
    assert {f[:10] for f in files} == {f"part-{p:05d}" for p in (0, 1, 3, 4, 5, 6)}
    assert layout["splits"]["train"]["files"][-1].startswith("part-00006")  # the tails
    train = layout["splits"]["train"]
    assert sum(train["row_group_sizes"]) == train["blocks"]
    stored = [pq.ParquetFile(tmp_path / "many" / "train" / f).metadata for f in train["files"]]
    assert train["file_groups"] == [m.num_row_groups for m in stored]
    assert train["row_group_sizes"] == [m.row_group(g).num_rows for m in stored
                                        for g in range(m.num_row_groups)]


def test_on_bad_record_error_names_file_and_line(corpus, tokenizer_dir, tmp_path, capsys):
    code = main(["prepare", "--output", str(tmp_path / "out"), f"--data.source={corpus}",
                 f"--tokenizer.path={tokenizer_dir}", "--data.on_bad_record=error",
                 f"--run.cache_dir={tmp_path}/cache"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"raylm: error: {corpus}/a.jsonl:41: malformed record." in err
    assert "Traceback" not in err


def test_cli_prepare_and_missing_path(corpus, tokenizer_dir, tmp_path, capsys):
    code = main(["prepare", "--output", str(tmp_path / "p"), f"--data.source={corpus}/b.txt",
                 f"--tokenizer.path={tokenizer_dir}", "--data.seq_len=15",
                 f"--run.cache_dir={tmp_path}/cache"])
    assert code == 0
    m = json.loads((tmp_path / "p" / "manifest.json").read_text())
    assert m["documents_read"] == 30 and m["block_length"] == 16
    code = main(["prepare", "--output", str(tmp_path / "q"), "--data.source=/no/such/corpus"])
    assert code == 2
    assert capsys.readouterr().err == "raylm: error: data.source: path not found: /no/such/corpus\n"


def test_two_ranks_read_disjoint_shards_covering_the_packed_set(corpus, tokenizer_dir, tmp_path):
    """Each rank's stream, built as a training worker builds its own (the order is a property
    of the data, not of which process asks): here both are read in the test's process, which
    saves a Ray Train worker group (~20 s here) that every training test starts anyway."""
    cfg = config(corpus, tokenizer_dir, tmp_path)
    out = tmp_path / "packed"
    prepare(cfg, out, log=lambda s: None)
    train = PackedSplit.load(out, "train")
    val = PackedSplit.load(out, "val")
    n, B = train.num_blocks, 4
    steps = n // B  # one epoch of whole global batches

    def read(rank: int, world: int) -> dict[str, list]:
        rows, positions, blocks = [], [], []
        train_ds = build_train_stream(out, rank=rank, world_size=world, start_step=0,
                                      num_steps=steps, seed=0, window=2, global_batch=B,
                                      resources={"CPU": 0.1})
        for batch in train_ds.iter_torch_batches(batch_size=B // 2, prefetch_batches=2):
            assert batch["input_ids"].shape == (B // 2, 32)
            rows += batch["row"].tolist()
            positions += batch["sample_position"].tolist()
            blocks += batch["input_ids"].tolist()
        val_rows = read_val_blocks(out, rank=rank, world_size=world,
                                   eval_samples=10**9)["row"].tolist()
        return {"rows": rows, "positions": positions, "blocks": blocks, "val_rows": val_rows}

    r0, r1 = read(0, 2), read(1, 2)
    # A longer stream (its ids in blocks of 256, then of 4,096): every position, in order,
    # the first epoch's as above.
    long = build_train_stream(out, rank=0, world_size=2, start_step=0, num_steps=2100, seed=0,
                              window=2, global_batch=B, resources={"CPU": 0.1})
    got = [p for b in long.iter_batches(batch_size=500) for p in b["sample_position"].tolist()]
    assert got == [s * B + j for s in range(2100) for j in range(2)]
    # Disjoint, and together the whole packed set (less the < B blocks of a partial batch).
    assert not set(r0["rows"]) & set(r1["rows"])
    assert len(r0["rows"]) == len(r1["rows"]) == steps * B // 2
    union = set(r0["rows"]) | set(r1["rows"])
    assert len(union) == steps * B and n - steps * B < B
    # Each rank holds its fixed slice of every global batch, in order.
    assert r0["positions"] == [s * B + j for s in range(steps) for j in range(2)]
    assert r1["positions"] == [s * B + 2 + j for s in range(steps) for j in range(2)]
    # The blocks read are the stored blocks of those rows.
    stored = pq.read_table(out / "train").column("input_ids").to_pylist()
    assert all(stored[r] == b for r, b in zip(r0["rows"] + r1["rows"],
                                                r0["blocks"] + r1["blocks"], strict=True))
    # Validation: round robin in storage order, equal counts, together every block but the
    # remainder of an odd count.
    assert not set(r0["val_rows"]) & set(r1["val_rows"])
    assert len(r0["val_rows"]) == len(r1["val_rows"]) == val.num_blocks // 2
    assert sorted(r0["val_rows"] + r1["val_rows"]) == list(range(val.num_blocks // 2 * 2))
    # The order is a shuffle, not storage order.
    assert np.any(np.diff(r0["rows"]) != 1)


def test_training_reads_a_prepared_directory_or_caches_one(corpus, tokenizer_dir, tmp_path):
    from raylm.data.preparation import prepared_dir

    cfg = config(corpus, tokenizer_dir, tmp_path)
    cached = prepared_dir(cfg, log=lambda s: None)  # raw source: prepared into the cache once
    assert cached.parent == tmp_path / "cache" / "prepared"
    assert prepared_dir(cfg, log=lambda s: None) == cached  # and reused
    manifest = json.loads((cached / "manifest.json").read_text())
    assert cached.name == manifest["fingerprint"]  # one fingerprint, not two
    direct = load_config(None, [f"--data.source={cached}", "--data.seq_len=31"])
    assert prepared_dir(direct) == cached
    wrong = load_config(None, [f"--data.source={cached}", "--data.seq_len=64"])
    with pytest.raises(ValueError, match="data.seq_len=64 but the prepared directory"):
        prepared_dir(wrong)
