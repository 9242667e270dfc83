"""Upstream adapters: one module per backend kind, one interface (base.Adapter)."""
