"""Prefect tasks: one logical step with a side effect. They pass paths, URLs and step numbers, never tensors."""
