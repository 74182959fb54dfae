"""Optional C accelerators; everything else is in pyproject.toml.

_hashchain (block hashing) needs libxxhash's header (Debian: libxxhash-dev);
_fastcopy (batched block copies), _presence (the disk tier's lookups) and
_slotio (its batched slot writes) only a C compiler. Whatever fails to build
is skipped, and the Python code that each replaces (cache_service/blocks/keys.py,
tiers/cpu.py, tiers/presence.py, tiers/disk_slots.py) produces the same
digests, bytes, answers and files.
"""
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any compiler failure means "no accelerator"
            print(f"tierkv: skipping C hash accelerator ({e})")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            print(f"tierkv: skipping C hash accelerator ({e})")


have_header = os.path.exists("/usr/include/xxhash.h")
ext = [Extension("tiers._fastcopy", ["tiers/_fastcopy.c"], depends=["tiers/_spans.h"], extra_compile_args=["-O2"]),
       Extension("tiers._presence", ["tiers/_presence.c"], extra_compile_args=["-O2"]),
       Extension("tiers._slotio", ["tiers/_slotio.c"], depends=["tiers/_spans.h"], extra_compile_args=["-O2"])]
if have_header:
    ext.append(Extension("cache_service.blocks._hashchain", ["cache_service/blocks/_hashchain.c"]))
setup(ext_modules=ext, cmdclass={"build_ext": OptionalBuildExt})
