#!/usr/bin/env bash
# Start a development RabbitMQ for QLM, configured by broker/rabbitmq.conf, with QLM's topology
# (broker/definitions.json) loaded. Prints the URL to export as QLM_BROKER_URL.
#
#   broker/start-local.sh            reuse the broker on 127.0.0.1:5672 if one runs (the topology
#                                    is imported into it), else start a private node on 5672
#   broker/start-local.sh --private  start a private node even when 5672 is taken
#                                    (port QLM_BROKER_PORT, default: first free from 5673)
#   broker/start-local.sh --stop     stop the private node started on QLM_BROKER_PORT (or 5672/5673)
#
# A private node runs as the current user from Debian's rabbitmq-server package (installed with
# apt-get when missing), with its data, logs and config under QLM_BROKER_BASE (default
# /tmp/qlm-rabbitmq-<port>); it touches nothing in /etc/rabbitmq or /var/lib/rabbitmq.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
definitions="$here/definitions.json"

say() { echo "start-local: $*" >&2; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

ensure_installed() {
    if [ ! -e /usr/lib/rabbitmq/bin/rabbitmq-server ]; then
        say "installing Debian's rabbitmq-server"
        as_root apt-get update -q
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q rabbitmq-server
    fi
    # The unwrapped scripts run as the current user (Debian's /usr/sbin wrappers switch to the
    # rabbitmq user, which could not write a private directory).
    sbin=$(dirname "$(readlink -f /usr/lib/rabbitmq/bin/rabbitmq-server)")
}

port_open() { timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

private_env() {
    port=$1
    base=${QLM_BROKER_BASE:-/tmp/qlm-rabbitmq-$port}
    node="qlm$port@localhost"
    export RABBITMQ_NODENAME="$node" RABBITMQ_NODE_PORT="$port" \
        RABBITMQ_DIST_PORT="$((port + 20000))" \
        RABBITMQ_CONFIG_FILE="$base/rabbitmq.conf" \
        RABBITMQ_ADVANCED_CONFIG_FILE="$base/advanced.config" \
        RABBITMQ_CONF_ENV_FILE="$base/rabbitmq-env.conf" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$base/enabled_plugins" \
        RABBITMQ_MNESIA_BASE="$base/mnesia" RABBITMQ_LOG_BASE="$base/log" \
        RABBITMQ_PID_FILE="$base/rabbitmq.pid"
}

start_private() {
    private_env "$1"
    if port_open "$port"; then
        say "port $port is taken"
        exit 1
    fi
    mkdir -p "$base/mnesia" "$base/log"
    sed -e "s|^listeners.tcp.default = .*|listeners.tcp.default = 127.0.0.1:$port|" \
        -e "s|^load_definitions = .*|load_definitions = $definitions|" \
        "$here/rabbitmq.conf" >"$base/rabbitmq.conf"
    : >"$base/rabbitmq-env.conf"
    echo "[]." >"$base/enabled_plugins"
    say "starting node $node on 127.0.0.1:$port (data in $base)"
    nohup "$sbin/rabbitmq-server" >"$base/log/startup.log" 2>&1 &
    if ! "$sbin/rabbitmqctl" -q -n "$node" wait --timeout 120 "$RABBITMQ_PID_FILE"; then
        say "the node did not start; see $base/log/startup.log"
        exit 1
    fi
    # load_definitions has declared the topology at boot; importing again makes it certain.
    "$sbin/rabbitmqctl" -q -n "$node" import_definitions "$definitions"
    # A node that loads definitions at first boot seeds no default user: add the dev one.
    if ! "$sbin/rabbitmqctl" -q -n "$node" list_users | grep -q '^guest\b'; then
        "$sbin/rabbitmqctl" -q -n "$node" add_user guest guest >/dev/null
        "$sbin/rabbitmqctl" -q -n "$node" set_user_tags guest administrator
    fi
    "$sbin/rabbitmqctl" -q -n "$node" set_permissions -p / guest '.*' '.*' '.*'
    echo "amqp://guest:guest@127.0.0.1:$port/%2F"
}

reuse_running() {
    # rabbitmqctl reaches the local node with its own defaults (/etc/rabbitmq/rabbitmq-env.conf).
    if rabbitmqctl -q import_definitions "$definitions" >/dev/null 2>&1; then
        say "reusing the broker on 127.0.0.1:5672; QLM's topology imported"
    else
        say "reusing the broker on 127.0.0.1:5672 (topology not imported: QLM declares it itself)"
    fi
    echo "amqp://guest:guest@127.0.0.1:5672/%2F"
}

free_port() {
    local p=${QLM_BROKER_PORT:-5673}
    while port_open "$p"; do p=$((p + 1)); done
    echo "$p"
}

case "${1:-}" in
"")
    if port_open 5672; then
        reuse_running
    else
        ensure_installed
        start_private "${QLM_BROKER_PORT:-5672}"
    fi
    ;;
--private)
    ensure_installed
    start_private "$(free_port)"
    ;;
--stop)
    ensure_installed
    for p in ${QLM_BROKER_PORT:-5672 5673}; do
        private_env "$p"
        if [ -f "$RABBITMQ_PID_FILE" ]; then
            say "stopping node $node"
            "$sbin/rabbitmqctl" -q -n "$node" stop "$RABBITMQ_PID_FILE"
        fi
    done
    ;;
*)
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
