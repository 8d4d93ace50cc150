"""The GPU pack: the wheels a lent GPU machine lacks, trimmed to travel with the working tree.

A lent GPU machine has no network at all, and its working tree (tracked files plus the folders a
run carries) may hold 64 MiB. Its Python has torch (CUDA), triton, transformers, accelerate,
peft, safetensors, tokenizers, numpy, pandas, pyarrow, scipy, httpx, pyyaml, tqdm, rich, psutil
and pytest, but not ray, lm-eval, datasets or pydantic. ``build`` (``make gpu-pack``) puts in
``.rayeval/gpu-pack/`` (ignored by git) the wheels of :data:`PACKED`, at the versions this
checkout's venv has, for the lent machine's Python (``--python-version``, 3.12 by default;
manylinux x86_64), trimmed where that saves most:

- ray: its Java jar, the dashboard's web client and the libraries a run does not import
  (rllib, serve, tune, train, data, llm) removed, its three native binaries stripped of symbols,
  its RECORD rewritten (79 MiB as downloaded);
- lm-eval: the bundled task folders removed (the check brings its own tasks).

and writes ``manifest.json`` (every wheel's name, version, size, sha256 and what was removed;
the total; the command that installs it). Downloads are cached in ``.rayeval/gpu-pack-cache/``,
so a rebuild is offline. The pack must stay under :data:`LIMIT_MIB`: the tracked tree is about
3.5 MiB, and what travels may be 64.

``install`` runs on the lent machine with its own ``python3`` and the standard library alone:
it checks each wheel's sha256 against the manifest, installs them with ``pip install --no-index
--no-deps --target`` (where the machine has no pip, or with ``--unpack``, by unzipping them, as
pip does for these wheels, their scripts aside), and links this checkout's ``actors``, ``api``
and ``service`` there as ``rayeval.actors``, ``rayeval.api`` and ``rayeval.service`` (what
``pip install -e .`` maps).
Then ``PYTHONPATH=<target> python3 benchmarks/gpu_check.py`` runs the check (Ray's workers
inherit ``PYTHONPATH``). The device tool carries only the ignored paths named in ``carry``:
name ``.rayeval/gpu-pack`` there. The whole command::

    python3 benchmarks/gpu_pack.py install --target /tmp/rayeval-site && \\
        PYTHONPATH=/tmp/rayeval-site python3 benchmarks/gpu_check.py

Usage here::

    make gpu-pack                                   # = the line below
    .venv/bin/python benchmarks/gpu_pack.py build   # cp312, into .rayeval/gpu-pack
    .venv/bin/python benchmarks/gpu_pack.py build --python-version 3.11 --out /tmp/pack
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / ".rayeval" / "gpu-pack"
DEFAULT_CACHE = REPO_ROOT / ".rayeval" / "gpu-pack-cache"
DEFAULT_TARGET = "/tmp/rayeval-site"
MIB = 2**20
#: Tracked files (about 3.5 MiB) plus the pack must stay under the 64 MiB a run may carry.
LIMIT_MIB = 48.0
#: The distributions the lent machine lacks that ``rayeval run`` at 1x1 and the GPU check
#: import, with why. Versions come from this checkout's venv. What the lent machine already has
#: (torch, transformers, huggingface-hub, numpy, pandas, httpx, pyyaml, ...) is not packed.
PACKED = {
    "ray": "the ranks, placement and the driver (trimmed)",
    "msgpack": "ray",
    "protobuf": "ray",
    "jsonschema": "ray",
    "jsonschema-specifications": "jsonschema",
    "referencing": "jsonschema",
    "rpds-py": "jsonschema",
    "attrs": "jsonschema",
    "requests": "ray",
    "urllib3": "requests",
    "charset-normalizer": "requests",
    "lm-eval": "requests, tasks and metrics (trimmed)",
    "datasets": "lm-eval's tasks",
    "dill": "datasets, lm-eval",
    "multiprocess": "datasets",
    "xxhash": "datasets",
    "sacrebleu": "lm-eval's metrics module",
    "portalocker": "sacrebleu",
    "tabulate": "sacrebleu",
    "colorama": "sacrebleu",
    "lxml": "sacrebleu",
    "pydantic": "rayeval's configuration",
    "pydantic-core": "pydantic",
    "annotated-types": "pydantic",
    "typing-inspection": "pydantic",
}
#: Folders removed from a wheel, by distribution (prefixes of the paths inside it).
TRIMMED = {
    "ray": (
        "ray/jars/",
        "ray/dashboard/client/",
        "ray/rllib/",
        "ray/serve/",
        "ray/tune/",
        "ray/train/",
        "ray/data/",
        "ray/llm/",
    ),
    "lm-eval": ("lm_eval/tasks/*/",),  # every task folder; lm_eval/tasks/*.py are kept
}
#: Native files stripped of symbols (``strip --strip-unneeded``).
STRIPPED = {
    "ray": ("ray/_raylet.so", "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet")
}
#: Bumped whenever what a trimmed wheel holds changes, so that a cached one is rebuilt.
TRIM_RECIPE = 1


@dataclass
class PackedWheel:
    """One wheel of the pack, as the manifest lists it."""

    file: str
    distribution: str
    version: str
    why: str
    bytes: int
    sha256: str
    downloaded_bytes: int
    removed: list[str] = field(default_factory=list)
    stripped: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- build
def normalise(name: str) -> str:
    """A distribution's name as wheel file names spell it (``lm-eval`` -> ``lm_eval``)."""
    return name.replace("-", "_").replace(".", "_").lower()


def pinned_versions(names: list[str]) -> dict[str, str]:
    """The version of each distribution installed where this runs (the checkout's venv).

    Raises:
        SystemExit: one is not installed (``make install`` first).
    """
    import importlib.metadata

    versions, missing = {}, []
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        raise SystemExit(f"not installed here, so no version to pin: {missing} (make install)")
    return versions


def cached_wheel(cache: Path, name: str, version: str) -> Path | None:
    """The cached wheel of ``name`` ``version``, if any."""
    found = sorted(cache.glob(f"{normalise(name)}-{version}-*.whl"))
    return found[0] if found else None


def download(cache: Path, pins: dict[str, str], python_version: str) -> dict[str, Path]:
    """Each pinned wheel, from the cache or downloaded into it (binary wheels only, manylinux
    x86_64 for ``python_version``)."""
    missing = [f"{n}=={v}" for n, v in pins.items() if cached_wheel(cache, n, v) is None]
    if missing:
        cache.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            python_version,
            "--implementation",
            "cp",
            "--platform",
            "manylinux2014_x86_64",
            "--dest",
            str(cache),
            *missing,
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"pip download failed ({' '.join(missing)}):\n{done.stderr[-3000:]}")
    wheels = {n: cached_wheel(cache, n, v) for n, v in pins.items()}
    absent = [n for n, path in wheels.items() if path is None]
    if absent:
        raise SystemExit(f"pip download gave no wheel for {absent}")
    return {n: path for n, path in wheels.items() if path is not None}


def removed_by(name: str, path: str) -> str | None:
    """The trim rule of :data:`TRIMMED` that removes ``path`` from ``name``'s wheel, if any."""
    for rule in TRIMMED.get(name, ()):
        if rule.endswith("*/"):
            parent = rule[:-2]
            rest = path[len(parent) :] if path.startswith(parent) else ""
            if "/" in rest:
                return parent + rest.split("/")[0] + "/"
        elif path.startswith(rule):
            return rule
    return None


def record_line(path: str, data: bytes) -> list[str]:
    """A RECORD row: path, ``sha256=`` urlsafe base64 digest without padding, size."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [path, f"sha256={digest}", str(len(data))]


def strip_symbols(data: bytes) -> bytes:
    """``data`` (an ELF file) with ``strip --strip-unneeded``; unchanged where strip is absent."""
    if shutil.which("strip") is None:
        return data
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "elf"
        path.write_bytes(data)
        subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)
        return path.read_bytes()


def trim_wheel(name: str, source: Path, dest: Path) -> tuple[list[str], list[str]]:
    """Copy ``source`` to ``dest`` without :data:`TRIMMED`'s folders, with :data:`STRIPPED`'s
    files stripped, and a RECORD that lists what is left; the folders removed and files
    stripped."""
    removed: set[str] = set()
    stripped: list[str] = []
    rows: list[list[str]] = []
    record_path = None
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if info.filename.endswith(".dist-info/RECORD"):
                record_path = info.filename
                continue
            rule = removed_by(name, info.filename)
            if rule is not None:
                removed.add(rule)
                continue
            data = src.read(info)
            if info.filename in STRIPPED.get(name, ()):
                data = strip_symbols(data)
                stripped.append(info.filename)
            out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
            rows.append(record_line(info.filename, data))
        if record_path is None:
            raise SystemExit(f"{source.name} has no RECORD")
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows([*rows, [record_path, "", ""]])
        out.writestr(record_path, text.getvalue())
    return sorted(removed), stripped


def sha256_of(path: Path) -> str:
    """The file's sha256, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(MIB), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pack_wheel(name: str, version: str, source: Path, out: Path, cache: Path) -> PackedWheel:
    """``source`` into ``out``, trimmed where :data:`TRIMMED` or :data:`STRIPPED` say (a
    trimmed wheel is cached, keyed by the source's sha256 and :data:`TRIM_RECIPE`)."""
    dest = out / source.name
    removed: list[str] = []
    stripped: list[str] = []
    if name in TRIMMED or name in STRIPPED:
        key = f"{sha256_of(source)[:16]}-r{TRIM_RECIPE}"
        trimmed = cache / "trimmed" / key / source.name
        notes = trimmed.with_suffix(".json")
        if not notes.is_file():
            trimmed.parent.mkdir(parents=True, exist_ok=True)
            removed, stripped = trim_wheel(name, source, trimmed)
            notes.write_text(json.dumps({"removed": removed, "stripped": stripped}))
        kept = json.loads(notes.read_text())
        removed, stripped = kept["removed"], kept["stripped"]
        shutil.copyfile(trimmed, dest)
    else:
        shutil.copyfile(source, dest)
    return PackedWheel(
        file=dest.name,
        distribution=name,
        version=version,
        why=PACKED[name],
        bytes=dest.stat().st_size,
        sha256=sha256_of(dest),
        downloaded_bytes=source.stat().st_size,
        removed=removed,
        stripped=stripped,
    )


def where(pack: Path) -> Path:
    """``pack`` relative to the checkout where it is inside it (as the lent machine sees it)."""
    try:
        return pack.resolve().relative_to(REPO_ROOT)
    except ValueError:
        return pack


def install_command(pack: Path, target: str) -> str:
    """The command that installs ``pack`` on the lent machine and runs the check there."""
    return (
        f"python3 benchmarks/gpu_pack.py install --pack {where(pack)} --target {target} && "
        f"PYTHONPATH={target} python3 benchmarks/gpu_check.py"
    )


def build(args: argparse.Namespace) -> int:
    """Build the pack; 1 when it is over ``--limit_mib``."""
    out, tag = Path(args.out), "cp" + args.python_version.replace(".", "")
    cache = Path(args.cache) / tag
    pins = pinned_versions(list(PACKED))
    wheels = download(cache, pins, args.python_version)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    packed = [pack_wheel(n, pins[n], wheels[n], out, cache) for n in PACKED]
    total = sum(w.bytes for w in packed)
    manifest = {
        "python": tag,
        "platform": "manylinux2014_x86_64",
        "bytes": total,
        "mib": round(total / MIB, 2),
        "limit_mib": args.limit_mib,
        "downloaded_mib": round(sum(w.downloaded_bytes for w in packed) / MIB, 2),
        "install_and_run": install_command(out, DEFAULT_TARGET),
        "wheels": [asdict(w) for w in packed],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for wheel in sorted(packed, key=lambda w: -w.bytes):
        trimmed = f"  (was {wheel.downloaded_bytes / MIB:.2f})" if wheel.removed else ""
        print(f"{wheel.bytes / MIB:7.2f} MiB  {wheel.file}{trimmed}")
    print(
        f"{manifest['mib']:.2f} MiB in {len(packed)} wheels for {tag} "
        f"(limit {args.limit_mib}; {manifest['downloaded_mib']} as downloaded): {out}"
    )
    print(f"on the lent machine (carry {where(out)}):\n  {manifest['install_and_run']}")
    if total > args.limit_mib * MIB:
        print(f"the pack is over its limit of {args.limit_mib} MiB", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- install
def install(args: argparse.Namespace) -> int:
    """Install the pack into ``--target`` with this Python's pip (no index, no dependencies)
    and link the checkout's packages there as ``rayeval``; 1 when a wheel does not match the
    manifest."""
    pack, target = Path(args.pack), Path(args.target)
    manifest = json.loads((pack / "manifest.json").read_text())
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if manifest["python"] != tag:
        print(
            f"the pack is for {manifest['python']}, this Python is {tag}: rebuild it with "
            f"make gpu-pack GPU_PACK_ARGS='--python-version {sys.version_info.major}."
            f"{sys.version_info.minor}'",
            file=sys.stderr,
        )
        return 1
    files = []
    for wheel in manifest["wheels"]:
        path = pack / wheel["file"]
        if not path.is_file() or sha256_of(path) != wheel["sha256"]:
            print(
                f"{path} is missing or not the manifest's (carry the whole pack)", file=sys.stderr
            )
            return 1
        files.append(str(path))
    if args.unpack or importlib.util.find_spec("pip") is None:
        for path in files:  # no pip on this machine: a wheel's files are a zip's
            unpack_wheel(Path(path), target)
    else:
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--no-warn-script-location",
            "--upgrade",
            "--target",
            str(target),
            *files,
        ]
        done = subprocess.run(command, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        if done.returncode:
            return done.returncode
    link_checkout(target)
    print(f"installed {len(files)} wheels ({manifest['mib']} MiB) into {target}")
    return 0


def unpack_wheel(wheel: Path, target: Path) -> None:
    """Install ``wheel`` into ``target`` as pip's ``--target`` does for the packed wheels:
    its files where they lie, those of ``*.data/purelib`` and ``*.data/platlib`` beside them,
    its scripts (``*.data/scripts``) left out."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            if info.is_dir() or not parts[-1]:
                continue
            dest = target.joinpath(*parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(archive.read(info))
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                dest.chmod(mode)


def link_checkout(target: Path) -> None:
    """``target/rayeval/{actors,api,service}`` -> this checkout's folders, as the project's
    package-dir maps them."""
    package = target / "rayeval"
    package.mkdir(parents=True, exist_ok=True)
    for name in ("actors", "api", "service"):
        link = package / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(REPO_ROOT / name, target_is_directory=True)


def main(argv: list[str] | None = None) -> int:
    """``build`` (here) or ``install`` (on the lent machine)."""
    parser = argparse.ArgumentParser(description="The wheels a lent GPU machine lacks.")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("build", help="build the pack (here, with the checkout's venv)")
    make.add_argument("--python-version", default="3.12", help="the lent machine's (3.12)")
    make.add_argument("--out", default=str(DEFAULT_OUT), help="the pack's folder")
    make.add_argument("--cache", default=str(DEFAULT_CACHE), help="downloaded wheels")
    make.add_argument("--limit_mib", type=float, default=LIMIT_MIB, help=f"({LIMIT_MIB})")
    put = sub.add_parser("install", help="install the pack (on the lent machine)")
    put.add_argument("--pack", default=str(DEFAULT_OUT), help="the pack's folder")
    put.add_argument("--target", default=DEFAULT_TARGET, help=f"({DEFAULT_TARGET})")
    put.add_argument("--unpack", action="store_true", help="unzip the wheels (what no pip does)")
    args = parser.parse_args(argv)
    return build(args) if args.command == "build" else install(args)


if __name__ == "__main__":
    sys.exit(main())
