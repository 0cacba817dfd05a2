"""Offline tools that build artefacts the package ships (e.g. the MTP draft head)."""
