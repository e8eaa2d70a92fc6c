"""Shared pieces of the apps: configuration files and command-line overrides."""
