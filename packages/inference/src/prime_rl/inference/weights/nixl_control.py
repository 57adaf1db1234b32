"""API-process checks for the NIXL transport (torch-free): the session's layout against the manifest."""

from __future__ import annotations

from prime_rl.common.nixl_metadata import MetadataClient
from prime_rl.common.wire import InitNixlRequest, NixlLayout
from prime_rl.inference.weights.manifest import Manifest, WeightUpdateError


def check_nixl_layout(manifest: Manifest, request: InitNixlRequest) -> NixlLayout:
    """Fetch the session's layout and refuse it unless it carries exactly the served checkpoint."""
    client = MetadataClient(request.host, request.port)
    try:
        layout = client.wait_get(f"{request.session}/layout", request.timeout_s, NixlLayout)
    finally:
        client.close()
    # Groups follow the broadcast bucket rules (256-byte aligned, in order, no overlap).
    source = f"NIXL session {request.session}"
    manifest.check_transfer(layout.specs, layout.groups, layout.offsets, layout.group_sizes, source)
    if layout.num_slots not in (1, 2) or layout.num_sources < 1:
        raise WeightUpdateError(
            f"NIXL layout has num_slots={layout.num_slots}, num_sources={layout.num_sources}; "
            "expected 1 or 2 slots and at least one trainer rank"
        )
    return layout
