#!/usr/bin/env python3
"""Build one kernels-hub variant of maxsim without Nix.

Compiles torch-ext plus one backend with torch's C++ extension tooling and
writes ``build/<variant>/`` the way kernel-builder lays out a build variant
(``__init__.py``, ``_ops.py``, ``_<id>.abi3.so``, a compatibility ``maxsim/``
folder and ``metadata.json`` with a digest), so that
``kernels.get_local_kernel(Path(repo), ...)`` and ``get_kernel`` with
``LOCAL_KERNELS`` load it.

    python tools/build.py --backend cpu       # CPU variant
    python tools/build.py --backend cuda      # CUDA variant (needs nvcc)
    python tools/build.py --check-cuda-compile  # nvcc syntax check, no GPU

Builds are incremental: objects live in ``.cache/build/<backend>/`` under a
name that depends on the compiler flags and torch version only, so ninja
recompiles just the sources that changed; when no input (sources, flags,
torch, this script) changed since the last build, nothing runs at all.
Compiler flags are portable by default; ``MAXSIM_NATIVE=1`` adds
``-march=native`` (the result then runs only on CPUs like the build machine's);
``MAXSIM_LINEINFO=1`` adds ``-lineinfo`` to CUDA builds (source lines in
profilers, at ~2.5x the device code).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = "maxsim"

REGISTRATION_H = r"""#pragma once
#include <Python.h>
#define _CONCAT(A, B) A##B
#define CONCAT(A, B) _CONCAT(A, B)
#define _STRINGIFY(A) #A
#define STRINGIFY(A) _STRINGIFY(A)
#define TORCH_LIBRARY_EXPAND(NAME, MODULE) TORCH_LIBRARY(NAME, MODULE)
#define TORCH_LIBRARY_IMPL_EXPAND(NAME, DEVICE, MODULE) TORCH_LIBRARY_IMPL(NAME, DEVICE, MODULE)
#define REGISTER_EXTENSION(NAME)                                              \
  PyMODINIT_FUNC CONCAT(PyInit_, NAME)() {                                    \
    static struct PyModuleDef module = {PyModuleDef_HEAD_INIT,                \
                                        STRINGIFY(NAME), nullptr, 0, nullptr}; \
    return PyModule_Create(&module);                                          \
  }
"""

OPS_PY = '''import torch
from . import {ext}
ops = torch.ops.{ext}


def add_op_namespace_prefix(op_name: str) -> str:
    return "{ext}::" + op_name
'''

COMPAT_INIT = '''# Compatibility package: re-exports the variant's top-level module.
import importlib.util
import sys
from pathlib import Path

_root = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "{ext}", _root / "__init__.py", submodule_search_locations=[str(_root)]
)
if "{ext}" in sys.modules:
    _mod = sys.modules["{ext}"]
else:
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["{ext}"] = _mod
    _spec.loader.exec_module(_mod)
globals().update({{k: v for k, v in vars(_mod).items() if not k.startswith("__")}})


def __getattr__(name):  # the parts the variant loads on first use
    return getattr(_mod, name)
'''


# Flags every CUDA build gets, here and in build.toml's cuda-flags (the
# kernel-builder release build): device code (SASS) compressed in the fatbin,
# several times smaller, decompressed by the driver when a module is first
# loaded.
RELEASE_CUDA_FLAGS = ["-Xfatbin=-compress-all"]


def build_toml() -> dict:
    import tomllib

    with open(ROOT / "build.toml", "rb") as f:
        return tomllib.load(f)


def sources(cfg: dict, backend: str) -> list[Path]:
    return [f for f in all_files(cfg, backend) if f.suffix in (".cpp", ".cu", ".mm")]


def all_files(cfg: dict, backend: str) -> list[Path]:
    files = [ROOT / s for s in cfg["torch"]["src"]]
    for kernel in cfg.get("kernel", {}).values():
        if kernel["backend"] == backend:
            files += [ROOT / s for s in kernel["src"]]
    return files


def ext_id(config: dict) -> str:
    """The extension's name (and op namespace) from the build configuration
    only: every object's compile command carries it, so a name that changed
    with the sources would make ninja recompile everything on any edit."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    return f"_{NAME}_{h.hexdigest()[:10]}"


def inputs_digest(backend: str) -> str:
    """Everything a build reads, without importing torch (so that an
    up-to-date check takes a fraction of a second): the installed torch and
    Python, the build's environment switches, this script, build.toml and
    every file of the directories compiled for ``backend``."""
    from importlib.metadata import version

    config = {"backend": backend, "torch": version("torch"), "python": sys.version,
              **{k: os.environ.get(k, "") for k in ("MAXSIM_NATIVE", "MAXSIM_CUDA_ARCHS", "CUTLASS_INCLUDE",
                                             "MAXSIM_LINEINFO")}}
    dirs = ["torch-ext", "maxsim-cpu"] + ([f"maxsim-{backend}"] if backend != "cpu" else [])
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    files = [Path(__file__).resolve(), ROOT / "build.toml"]
    files += [p for d in dirs for p in (ROOT / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for f in sorted(files):
        h.update(f.relative_to(ROOT).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def up_to_date(backend: str, out: Path, digest_in: str) -> Path | None:
    """The variant a previous build made from the same inputs, if it is intact."""
    stamp = ROOT / ".cache" / "build" / backend / "inputs.sha256"
    if not stamp.exists():
        return None
    lines = stamp.read_text().split("\n")
    if len(lines) < 3 or lines[0] != digest_in:
        return None
    variant = out / lines[1]
    if (variant / "metadata.json").exists() and (variant / f"{lines[2]}.abi3.so").exists():
        return variant
    return None


def variant_name(backend: str) -> str:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    arch = platform.machine()
    osname = "linux" if sys.platform.startswith("linux") else ("darwin" if sys.platform == "darwin" else sys.platform)
    if backend == "cpu":
        tag = "cpu"
    elif backend == "cuda":
        tag = "cu" + torch.version.cuda.replace(".", "")[:3]
    elif backend == "metal":
        tag = "metal"
    else:
        tag = backend
    return f"torch{major}{minor}-cxx11-{tag}-{arch}-{osname}"


def cuda_archs() -> list[str]:
    env = os.environ.get("MAXSIM_CUDA_ARCHS")
    if env:
        return env.split(";")
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return [f"{major}.{minor}{'a' if major == 9 else ''}"]
    return ["8.0", "9.0a"]


def section_archs(kernel: dict, archs: list[str]) -> list[str]:
    """The archs a CUDA section compiles for: a section of arch-specific
    capabilities only (sm_90a) takes the requested ones among them, or its
    own list when none is requested (its host code links either way); the
    other sections take the requested archs."""
    caps = kernel.get("cuda-capabilities", [])
    if not caps or not all(c.endswith("a") for c in caps):
        return archs
    return [a for a in archs if a in caps] or caps


def gencode(archs: list[str]) -> list[str]:
    flags = []
    for a in archs:
        ptx = a.endswith("+PTX")
        a = a.removesuffix("+PTX")
        num = a.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def digest(variant: Path) -> dict:
    files = {}
    for p in sorted(variant.rglob("*")):
        if p.is_file() and p.name != "metadata.json" and "__pycache__" not in p.parts:
            files[p.relative_to(variant).as_posix()] = base64.b64encode(
                hashlib.sha256(p.read_bytes()).digest()
            ).decode()
    return {"algorithm": "sha256", "files": files}


def generated_headers(cache: Path) -> Path:
    """A stable folder for registration.h: a fresh one per call would change
    every compile command and defeat incremental builds."""
    gen = cache / "gen"
    gen.mkdir(parents=True, exist_ok=True)
    header = gen / "registration.h"
    if not header.exists() or header.read_text() != REGISTRATION_H:
        header.write_text(REGISTRATION_H)
    return gen


def build(backend: str, out: Path, verbose: bool, digest_in: str) -> Path:
    import torch
    from torch.utils import cpp_extension

    cfg = build_toml()
    files = all_files(cfg, backend)
    variant = out / variant_name(backend)
    cache = ROOT / ".cache" / "build" / backend
    gen = generated_headers(cache)

    include = [str(gen), str(ROOT / "torch-ext")] + sorted({str(f.parent) for f in files})
    cflags = ["-O3", "-std=c++17", "-fopenmp"] + (["-DCPU_KERNEL"] if backend == "cpu" else [])
    if os.environ.get("MAXSIM_NATIVE", "0") == "1":
        # Opt-in only: an artifact tuned for this CPU crashes on older ones.
        cflags.append("-march=native")
    cuda_flags = []
    archs = None
    if backend == "cuda":
        cflags.append("-DCUDA_KERNEL")
        archs = cuda_archs()
        cuda_flags = ["-O3", "-std=c++17", "-DCUDA_KERNEL", "--expt-relaxed-constexpr"] + RELEASE_CUDA_FLAGS
        if os.environ.get("MAXSIM_LINEINFO", "0") == "1":
            # For profilers' source view only: line tables and the PTX text
            # they map to are ~60% of the device code (see RELEASE_CUDA_FLAGS).
            cuda_flags.append("-lineinfo")
        cuda_flags += gencode(archs)
        cutlass = os.environ.get("CUTLASS_INCLUDE")
        if cutlass:
            include.append(cutlass)
    ldflags = ["-fopenmp"]
    if backend == "metal":
        # macOS: Objective-C++ glue, shaders compiled at first use from the
        # checkout (maxsim-metal/), Apple clang has no -fopenmp.
        cflags = [f for f in cflags if f not in ("-fopenmp", "-march=native")] + ["-DMETAL_KERNEL"]
        ldflags = ["-framework", "Metal", "-framework", "Foundation"]
    config = {"backend": backend, "torch": torch.__version__, "cflags": cflags, "cuda_flags": cuda_flags,
              "ldflags": ldflags, "include": include}
    ext = ext_id(config)
    stamp = cache / "inputs.sha256"
    stamp.unlink(missing_ok=True)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
    cpp_extension.load(
        name=ext,
        sources=[str(s) for s in sources(cfg, backend)],
        extra_include_paths=include,
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_flags,
        extra_ldflags=ldflags,
        build_directory=str(cache),
        is_python_module=False,
        verbose=verbose,
        with_cuda=backend == "cuda",
    )
    so = cache / f"{ext}.so"

    if variant.exists():
        shutil.rmtree(variant)
    variant.mkdir(parents=True)
    pkg = ROOT / "torch-ext" / NAME
    for p in pkg.rglob("*"):
        if p.is_file() and "__pycache__" not in p.parts:
            dst = variant / p.relative_to(pkg)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dst)
    shutil.copy2(so, variant / f"{ext}.abi3.so")
    (variant / "_ops.py").write_text(OPS_PY.format(ext=ext))
    (variant / NAME).mkdir()
    (variant / NAME / "__init__.py").write_text(COMPAT_INIT.format(ext=ext))
    meta = {
        "id": ext,
        "name": NAME,
        "version": cfg["general"].get("version", 1),
        "license": cfg["general"].get("license", "Apache-2.0"),
        "backend": {"type": backend} | ({"archs": archs} if archs else {}),
        "python-depends": [],
    }
    meta["digest"] = digest(variant)
    (variant / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    stamp.write_text(f"{digest_in}\n{variant.name}\n{ext}\n")
    print(f"built {variant.relative_to(ROOT) if variant.is_relative_to(ROOT) else variant} ({ext})")
    return variant


def check_cuda_compile(archs: list[str]) -> None:
    """Compile every CUDA source with nvcc (device code only, no GPU needed)."""
    from torch.utils import cpp_extension

    cfg = build_toml()
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    inc = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{ROOT / 'torch-ext'}"]
    inc.append(f"-I{generated_headers(ROOT / '.cache' / 'build' / 'cuda-check')}")
    # Headers a CPU-only machine lacks (CUDA math libraries, torch's generated
    # CUDA config); searched after torch's and the toolkit's own.
    inc.append(f"-I{ROOT / 'tools' / 'cuda_compile_stubs'}")
    cutlass = os.environ.get("CUTLASS_INCLUDE")
    if cutlass:
        inc.append(f"-I{cutlass}")
    jobs = [(a, ROOT / s) for k in cfg.get("kernel", {}).values() if k["backend"] == "cuda"
            for a in section_archs(k, archs) for s in k["src"] if s.endswith(".cu")]

    # Device code only: the front end still checks every host function, and
    # skipping the host compiler halves the time. The newest architecture
    # goes through ptxas (it validates the inline PTX of every path); the
    # others stop at PTX, since their inline assembly is the same.
    newest = max(archs, key=lambda a: float(a.removesuffix("+PTX").rstrip("a")))

    def compile_one(job):
        arch, cu = job
        num = arch.removesuffix("+PTX").replace(".", "")
        target = ["-cubin", f"-gencode=arch=compute_{num},code=sm_{num}"] if arch == newest else \
            ["-ptx", f"-arch=compute_{num}"]
        cmd = [nvcc, "-std=c++17", "-DCUDA_KERNEL", "--expt-relaxed-constexpr", *target, *inc,
               f"-I{cu.parent}", str(cu), "-o", os.devnull]
        r = subprocess.run(cmd, capture_output=True, text=True)
        print(f"nvcc {arch} {cu.relative_to(ROOT).as_posix()}: {'ok' if r.returncode == 0 else 'FAILED'}", flush=True)
        return cu, arch, r

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(compile_one, jobs))
    failed = [(cu, arch, r) for cu, arch, r in results if r.returncode]
    for cu, arch, r in failed:
        sys.stderr.write(r.stdout + r.stderr)
    if failed:
        raise SystemExit(f"nvcc failed on {len(failed)} compile(s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "metal"])
    ap.add_argument("--out", default=str(ROOT / "build"))
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--check-cuda-compile", action="store_true")
    ap.add_argument("--force", action="store_true", help="build even when no input changed")
    args = ap.parse_args()
    if args.check_cuda_compile:
        check_cuda_compile(os.environ.get("MAXSIM_CUDA_ARCHS", "8.0;9.0a").split(";"))
        return
    out = Path(args.out)
    digest_in = inputs_digest(args.backend)
    variant = None if args.force else up_to_date(args.backend, out, digest_in)
    if variant is not None:
        print(f"up to date: {variant.relative_to(ROOT) if variant.is_relative_to(ROOT) else variant}")
        return
    build(args.backend, out, args.verbose, digest_in)


if __name__ == "__main__":
    main()
