"""Test support that ships with the package: fault injection into real runs (``VERL_DS_FAULT``)."""
