"""Prepare a local JSONL dataset as a TFDS dataset in the array_record format, offline and without TensorFlow.

    python tools/prepare_tfds.py --jsonl-dir ../shared/data/gsm8k --name gsm8k_local --data-dir DIR

Every {split}.jsonl in --jsonl-dir becomes a split. The result is DIR/NAME/VERSION/ with dataset_info.json,
features.json and NAME-{split}.array_record-0000x-of-0000y, which is what `tfds.data_source(NAME,
split=..., data_dir=DIR)` reads (then `source: tfds`, `tfds_name: NAME`, `tfds_data_dir: DIR` in the data
config).

How, without TensorFlow: a GeneratorBasedBuilder with file_format="array_record" writes through
array_record and serialises examples with TFDS's own protobuf code, so tfds 4.9.x needs no TensorFlow to
build or read it (it does need importlib_resources, which tfds imports but does not declare). Two details
matter here:
  - the builder class is made per call with skip_registration=True, so a name can be prepared more than once
    in a process and never clashes with the TFDS catalog; the reader then finds it by name in DIR;
  - disable_shuffling=True keeps the JSONL row order, so TFDS index i is JSONL row i (the same
    dataset_index as source: jsonl). TFDS otherwise reorders examples by a hash of their key.
The schema comes from the first row of the first split: str -> Text, int -> int64, float -> float64,
bool -> bool. Every row must have exactly those fields and types (TFDS stores a fixed schema, so a
malformed row is refused here with its file and line, rather than stored).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path


def _feature(value, where: str):
    import numpy as np
    import tensorflow_datasets as tfds

    if isinstance(value, bool):  # before int: bool is an int
        return tfds.features.Scalar(np.bool_)
    if isinstance(value, int):
        return tfds.features.Scalar(np.int64)
    if isinstance(value, float):
        return tfds.features.Scalar(np.float64)
    if isinstance(value, str):
        return tfds.features.Text()
    raise ValueError(f"{where}: {type(value).__name__} values are not supported (str, int, float, bool)")


def _kind(value) -> type:
    return bool if isinstance(value, bool) else int if isinstance(value, int) else type(value)


def _read_rows(path: Path, max_rows: int | None) -> list[tuple[int, dict]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue  # as JsonlSource: blank lines are not rows
            if max_rows is not None and len(rows) >= max_rows:
                break
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {line_no}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {line_no}: expected a JSON object, got {type(row).__name__}")
            rows.append((line_no, row))
    return rows


def prepare_jsonl_as_tfds(jsonl_dir: str | Path, name: str, data_dir: str | Path, *,
                          splits: list[str] | None = None, max_rows: int | None = None, version: str = "1.0.0",
                          overwrite: bool = False) -> Path:
    """Write {split}.jsonl files of jsonl_dir as the TFDS dataset `name` under data_dir; returns its directory.

    splits: which splits (default: every *.jsonl); max_rows: keep the first N rows of each split (tests).
    """
    import tensorflow_datasets as tfds

    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"name={name!r}: TFDS names are snake_case: lowercase letters, digits and _")
    jsonl_dir, data_dir = Path(jsonl_dir), Path(data_dir)
    if splits is None:
        splits = sorted(p.stem for p in jsonl_dir.glob("*.jsonl"))
        if not splits:
            raise ValueError(f"{jsonl_dir}: no *.jsonl files")
    split_rows = {}
    for split in splits:
        path = jsonl_dir / f"{split}.jsonl"
        if not path.is_file():
            raise ValueError(f"{path}: not found (split {split!r})")
        split_rows[split] = (path, _read_rows(path, max_rows))
        if not split_rows[split][1]:
            raise ValueError(f"{path}: no rows")

    first_path, first_rows = split_rows[splits[0]]
    schema = first_rows[0][1]
    features = {k: _feature(v, f"{first_path} line {first_rows[0][0]} field {k!r}") for k, v in schema.items()}
    kinds = {k: _kind(v) for k, v in schema.items()}
    for path, rows in split_rows.values():
        for line_no, row in rows:
            if set(row) != set(kinds) or any(_kind(row[k]) is not t for k, t in kinds.items()):
                got = {k: type(v).__name__ for k, v in row.items()}
                want = {k: t.__name__ for k, t in kinds.items()}
                raise ValueError(f"{path} line {line_no}: fields {got} differ from the schema {want} "
                                 f"(taken from {first_path} line {first_rows[0][0]})")

    target = data_dir / name / version
    if target.exists():
        if not overwrite:
            raise ValueError(f"{target}: already prepared (pass overwrite=True / --overwrite to rebuild)")
        shutil.rmtree(target)

    dataset_name = name

    class JsonlBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        name = dataset_name  # set here: TFDS would otherwise derive it from the class or module name
        VERSION = tfds.core.Version(version)

        def _info(self):
            # DatasetInfo directly: dataset_info_from_configs would look for metadata files beside this module.
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features),
                                         disable_shuffling=True,
                                         description=f"Prepared from {jsonl_dir} by tools/prepare_tfds.py")

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(rows) for split, (_, rows) in split_rows.items()}

        def _generate_examples(self, rows):
            for i, (_, row) in enumerate(rows):
                yield i, row

    tfds.disable_progress_bar()
    with tempfile.TemporaryDirectory() as downloads:  # nothing is downloaded; keep data_dir free of it
        builder = JsonlBuilder(data_dir=str(data_dir), file_format="array_record")
        builder.download_and_prepare(download_dir=downloads,
                                     download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jsonl-dir", required=True, help="directory with {split}.jsonl files")
    parser.add_argument("--name", required=True, help="TFDS dataset name (snake_case), e.g. gsm8k_local")
    parser.add_argument("--data-dir", required=True, help="TFDS data_dir to write into")
    parser.add_argument("--splits", nargs="*", default=None, help="splits to prepare (default: every *.jsonl)")
    parser.add_argument("--max-rows", type=int, default=None, help="keep only the first N rows of each split")
    parser.add_argument("--version", default="1.0.0")
    parser.add_argument("--overwrite", action="store_true", help="rebuild an already prepared version")
    args = parser.parse_args(argv)
    try:
        target = prepare_jsonl_as_tfds(args.jsonl_dir, args.name, args.data_dir, splits=args.splits,
                                       max_rows=args.max_rows, version=args.version, overwrite=args.overwrite)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"prepared {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
