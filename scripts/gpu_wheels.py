"""Build the wheel set that carries Ray and raylm to a GPU machine without network.

    python scripts/gpu_wheels.py [--output .whl]          # about 1 minute with a warm cache

The GPU machines this project is lent have CUDA, torch 2.11, transformers 5.17, peft, pyarrow,
pandas, numpy, grpcio, protobuf, msgpack, aiohttp, psutil, tokenizers, safetensors, pyyaml,
requests, click, filelock, fsspec, nvidia-ml-py, but not Ray, nor the pure-Python pieces Ray Train
and Tune import, nor raylm; they reach no package index, and a command takes at most 64 MiB of
the project with it. The same set serves an air-gapped cluster with such an image. Installed
there without dependency resolution (the image's packages are what is tested there), exactly as
``scripts/gpu_run.sh`` does::

    pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

Ray's wheel for CPython 3.12 is 75.6 MiB. It is rewritten without the parts that a local
``ray.init``/``ray start`` driving Train, Data and Tune never imports (``TRIM`` says why for each),
which leaves about 40 MiB; the rewrite is a valid wheel (its RECORD lists exactly the files kept,
with their hashes). The set must stay under 60 MiB, room left under the 64 MiB a call carries for
the repository itself; the script fails above that.

MLflow is not in the set (its wheels with their SQL and server parts are about 40 MiB more): runs
on a GPU machine use ``tracking.enabled: false``. Optuna (``tune.search: optuna``) is left out
too; the default random and grid searches are Ray Tune's own.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT_MIB = 60.0

RAY = "ray==2.60.0"
# What Ray Train V2, Ray Data, Ray Tune and raylm import that the GPU image lacks, at the versions
# raylm's CPU environment resolves (scripts/env.sh), so both sides run the same code.
PACKAGES = [
    # Ray's core validates runtime environments with jsonschema.
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    # Ray Train V2's and Tune's configuration models.
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    # pydantic 2.14 needs a newer typing_extensions than some images carry; it is backward
    # compatible, so the newer one on PYTHONPATH serves the image's packages too.
    "typing-extensions==4.16.0",
    # Ray Tune imports its TensorBoard logger at start.
    "tensorboardX==2.6.5",
    # QLoRA's NF4 base and `raylm export --quantize int8`.
    "torchao==0.18.0",
]
# The target: the GPU image's interpreter (CPython 3.12.3, x86-64, glibc 2.35+).
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--abi", "cp312", "--abi", "abi3", "--abi", "none",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
            "--platform", "any"]

# Parts of Ray's wheel that raylm never imports, with why each can go.
TRIM = {
    "ray/jars/": "Java workers and the Java API (30.7 MiB); raylm's workers are Python",
    "ray/dashboard/client/": "the dashboard's web client (2.4 MiB); Ray starts without the "
                             "dashboard there, and its Python agent stays",
    "ray/rllib/": "reinforcement learning; nothing in Train, Tune or Data imports it",
    "ray/serve/": "model serving; imported by none of Train, Tune or Data",
    "ray/llm/": "Ray's LLM serving and batch inference (vLLM); imported only on request",
    "ray/cpp/": "the C++ API's headers and library",
    "ray/tune/examples/": "example scripts",
}


def _sha256(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def trim_wheel(src: Path, dst: Path, *, drop: tuple[str, ...]) -> tuple[int, int]:
    """Copy wheel ``src`` to ``dst`` without the files under ``drop``; rewrite its RECORD.

    Returns (files kept, files dropped)."""
    kept = dropped = 0
    with zipfile.ZipFile(src) as zin:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                if info.filename == record_name:
                    continue
                if info.filename.startswith(drop):
                    dropped += 1
                    continue
                data = zin.read(info)
                zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
                if not info.is_dir():
                    rows.append((info.filename, _sha256(data), str(len(data))))
                kept += 1
            rows.append((record_name, "", ""))
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(rows)
            zout.writestr(record_name, buf.getvalue())
    return kept, dropped


def download(spec: str, dest: Path) -> Path:
    """One wheel for the GPU image's interpreter and platform (cached in ``dest``)."""
    name = spec.split("==")[0].replace("-", "_").lower()
    version = spec.split("==")[1]
    for have in dest.glob("*.whl"):
        parts = have.name.split("-")
        if parts[0].lower() == name and parts[1] == version:
            return have
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--disable-pip-version-check", *PLATFORM, "-d", str(dest), spec], check=True)
    return download(spec, dest)


def build(output: Path, *, cache: Path) -> float:
    cache.mkdir(parents=True, exist_ok=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the output and renamed into place: a failed build leaves the old set whole.
    stage = Path(tempfile.mkdtemp(prefix=f"{output.name}.partial-", dir=output.parent))
    try:
        ray_wheel = download(RAY, cache)
        kept, dropped = trim_wheel(ray_wheel, stage / ray_wheel.name, drop=tuple(TRIM))
        print(f"ray: {ray_wheel.stat().st_size / 2**20:.1f} MiB -> "
              f"{(stage / ray_wheel.name).stat().st_size / 2**20:.1f} MiB "
              f"({kept} files kept, {dropped} dropped)")
        for spec in PACKAGES:
            shutil.copy2(download(spec, cache), stage)
        # raylm itself (its version from pyproject.toml), built from a copy of this checkout's
        # files (tracked, and new ones git does not ignore): built in place, setuptools reuses
        # build/lib, and a module deleted since the last build went into the wheel.
        source = stage / "source"
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached",
                                 "--others", "--exclude-standard"], check=True,
                                capture_output=True).stdout.decode().split("\0")
        for name in filter(None, listed):
            if (ROOT / name).is_file():
                (source / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, source / name)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                        "--disable-pip-version-check",
                        "-w", str(stage), str(source)], check=True)
        shutil.rmtree(source)
        wheels = sorted(stage.glob("*.whl"))
        total = sum(w.stat().st_size for w in wheels) / 2**20
        for w in wheels:
            print(f"  {w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
        print(f"total: {total:.1f} MiB in {len(wheels)} wheels (limit {LIMIT_MIB:.0f} MiB)")
        if total > LIMIT_MIB:
            raise SystemExit(f"gpu_wheels: the set is {total:.1f} MiB, over {LIMIT_MIB:.0f} MiB: "
                             "a GPU machine takes 64 MiB per command, the repository included")
        if output.exists():
            # Only ever a folder this script made: it holds wheels and nothing else.
            strays = [p.name for p in output.iterdir() if p.suffix != ".whl"]
            if strays:
                raise SystemExit(f"gpu_wheels: {output} holds files this script did not write "
                                 f"({', '.join(strays[:5])}); choose another --output")
            shutil.rmtree(output)
        stage.rename(output)
        return total
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=ROOT / ".whl",
                        help="folder for the wheel set (default .whl, ignored by git)")
    parser.add_argument("--cache", type=Path, default=ROOT / "build" / "wheel-cache",
                        help="where downloaded wheels are kept between builds")
    args = parser.parse_args()
    build(args.output.resolve(), cache=args.cache.resolve())


if __name__ == "__main__":
    main()
