"""Images, clips and prompt markers, below every family: decoding (Pillow, PyAV) and checks,
resizing as Pillow resizes, rescaling and normalising, and replacing a prompt's markers. The
families' processors (:mod:`fusion.families`) stand on these; :mod:`fusion.preprocessing` is
the public face of both."""
