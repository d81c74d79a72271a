"""dxserve: differentiation as a service."""
