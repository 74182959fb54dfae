"""Optional C accelerator for block hashing; everything else is in pyproject.toml.

The extension needs libxxhash's header (Debian: libxxhash-dev). Without it
the build skips the extension and cache_service.keys uses its Python loop,
which produces the same digests.
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
ext = [Extension("cache_service._hashchain", ["cache_service/_hashchain.c"], libraries=["xxhash"])]
setup(ext_modules=ext if have_header else [], cmdclass={"build_ext": OptionalBuildExt})
