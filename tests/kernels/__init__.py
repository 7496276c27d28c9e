import pytest
from headrace.kernels import native

#: Tests of the C kernels need a C compiler to build them. Without one there is nothing to
#: test there (the engine runs on the torch references, which every other test covers); with
#: one, a kernel that fails to build fails these tests instead of skipping them.
needs_c_compiler = pytest.mark.skipif(
    native.compiler() is None, reason="no C compiler on this machine: no C kernels to test"
)
