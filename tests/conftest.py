import os

# Tests run on whatever CPU there is; keep XLA from grabbing every thread
# oddly and never touch the network.
os.environ.setdefault('TFDS_DISABLE_GCS', '1')
