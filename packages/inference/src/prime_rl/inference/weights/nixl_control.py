"""API-process checks for the NIXL transport (torch-free): the session's layout against the manifest."""

from __future__ import annotations

from prime_rl.common.nixl_metadata import MetadataClient
from prime_rl.common.wire import InitNixlRequest, NixlLayout
from prime_rl.inference.weights.manifest import ITEMSIZE, Manifest, Spec, WeightUpdateError, check_bucket_layout


def check_nixl_layout(manifest: Manifest, request: InitNixlRequest) -> NixlLayout:
    """Fetch the session's layout and refuse it unless it carries exactly the served checkpoint."""
    client = MetadataClient(request.host, request.port)
    try:
        layout = client.wait_get(f"{request.session}/layout", request.timeout_s, NixlLayout)
    finally:
        client.close()
    for spec in layout.specs:
        if spec.dtype not in ITEMSIZE:
            raise WeightUpdateError(f"tensor {spec.name} has unsupported dtype {spec.dtype!r}")
    specs = {s.name: Spec(s.dtype, tuple(s.shape)) for s in layout.specs}
    names = [s.name for s in layout.specs]
    # Groups follow the broadcast bucket rules (256-byte aligned, in order, no overlap).
    check_bucket_layout(names, [specs[n] for n in names], layout.groups, layout.offsets, layout.group_sizes)
    manifest.check(specs, source=f"NIXL session {request.session}")
    if layout.num_slots not in (1, 2) or layout.num_sources < 1:
        raise WeightUpdateError(
            f"NIXL layout has num_slots={layout.num_slots}, num_sources={layout.num_sources}; "
            "expected 1 or 2 slots and at least one trainer rank"
        )
    return layout
