"""How requests are written for each kind of upstream: frozen values, one per detection."""
