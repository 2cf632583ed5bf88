"""A rank's weights: reading a checkpoint's tensors (``weight_loader``), its quantization formats
(``quantization``), the default model's download (``default_model``) and the dtype "auto" becomes
(``dtype_choice``)."""
