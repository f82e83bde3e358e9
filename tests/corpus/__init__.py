"""A corpus of real Keras programs (keras.io styles), each run on one device and distributed.

See README.md in this folder for the protocol every program follows, and
`corpus.harness` for how a run is made and compared.
"""
