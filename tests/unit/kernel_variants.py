"""Every ISA variant of the native kernels this host runs (tandem/kernels/cpu_isa.py: AVX2,
AVX-VNNI, AVX-512 VNNI), as a pytest parameter: a test module that sets `autouse_variants`
(or a test that takes `each_variant`) runs once per variant, with that variant's build as the
library every wrapper calls (`library.using`). An AVX-512 host so tests its AVX2 code too."""

import pytest

from tandem.kernels import library

NAMES = library.variants() if library.available() else ()
PARAMS = NAMES or [pytest.param(None, marks=pytest.mark.skip(reason=f"no native: {library.why()}"))]


@pytest.fixture(params=PARAMS)
def each_variant(request):
    """The variant's name; `library.library()` is its build for the test."""
    with library.using(request.param):
        yield request.param
