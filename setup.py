"""Build the optional C helpers (tierkv._native); the package works without them."""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """Skip the extension, with a warning, when no compiler is usable."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler, missing headers
            print(f"warning: tierkv._native not built ({exc}); pure-Python fallbacks will be used")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"warning: {ext.name} not built ({exc}); pure-Python fallbacks will be used")


setup(
    ext_modules=[Extension("tierkv._native", ["native/tierkv_native.c", "native/attend.c",
                                             "native/bounds.c", "native/select.c"],
                           depends=["native/kernels.h", "native/simd.h"],
                           extra_compile_args=["-O3"], optional=True)],
    cmdclass={"build_ext": OptionalBuildExt},
)
