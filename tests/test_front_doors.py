"""The packages' front doors: every name they promise resolves, and importing
them pulls in nothing heavy (no gRPC, no vLLM) until a name is asked for."""
import subprocess
import sys

import pytest

import cache_service
import connectors


@pytest.mark.parametrize("package", [cache_service, connectors])
def test_every_exported_name_resolves(package):
    # each name in __all__ is what its module defines
    for name in package.__all__:
        assert getattr(package, name) is not None, name
    # an unknown name is an AttributeError, as for any module
    with pytest.raises(AttributeError):
        getattr(package, "no_such_name")


def test_importing_the_front_doors_imports_no_transport():
    # a fresh interpreter imports both packages: gRPC and vLLM stay unloaded
    code = ("import sys, cache_service, connectors; "
            "print(sorted(m for m in ('grpc', 'vllm', 'cache_service.store', 'connectors.grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
