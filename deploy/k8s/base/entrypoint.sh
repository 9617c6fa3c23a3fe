#!/bin/sh
# Entry point of the pods on a node's shared memory: the kvstore (DaemonSet) and the prefill and
# decode workers. `sh entrypoint.sh services.decode ARGS...` runs `python -m services.decode ARGS...`
# with PDSERVE_KVSTORE set to this node's kvstore name, which both sides read: the kvstore as its
# --store, a worker as its --kvstore. One expression, here only, so the names always agree.
#
# The name is kv-<node name> with every character a NATS subject token cannot hold (node names
# carry dots: ip-10-0-1-5.ec2.internal) turned into '-'.
set -eu
: "${NODE_NAME:?NODE_NAME must be set (downward API: spec.nodeName)}"
PDSERVE_KVSTORE="kv-$(printf '%s' "$NODE_NAME" | tr -c 'A-Za-z0-9_-' '-')"
export PDSERVE_KVSTORE
exec python -m "$@"
