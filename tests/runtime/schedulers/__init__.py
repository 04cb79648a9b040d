"""Tests of the numpy schedulers against diffusers (a package so test module names stay unique)."""
