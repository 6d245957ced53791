"""Placeholder: replaced by the pipeline implementation."""
