"""Bridges to outside engines (DeepSpeed), each behind one module."""
