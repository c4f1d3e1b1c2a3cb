"""Contained compatibility shims, each active only where its trigger condition holds."""
