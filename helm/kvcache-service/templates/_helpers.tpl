{{/*
Names and labels.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "kvcache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The resource name: fullnameOverride, else <release>-<name> unless the release already contains it. */}}
{{- define "kvcache.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "kvcache.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvcache.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Selector labels. The component label keeps the helm test pod (component "test") out of the Service,
which selects on these.
*/}}
{{- define "kvcache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvcache.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: kv-cache
{{- end -}}

{{/* Labels every object carries, without the component (each object names its own). */}}
{{- define "kvcache.commonLabels" -}}
helm.sh/chart: {{ include "kvcache.chart" . }}
app.kubernetes.io/name: {{ include "kvcache.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvcache.labels" -}}
{{ include "kvcache.commonLabels" . }}
app.kubernetes.io/component: kv-cache
{{- end -}}

{{- define "kvcache.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvcache.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvcache.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The default image.repository: no image was ever built or published there (NOTES.txt warns). */}}
{{- define "kvcache.unbuiltRepository" -}}
ghcr.io/kvcache/kvcache-service
{{- end -}}

{{/*
Addresses.
*/}}

{{/* The --listen address: host:port, IPv6 hosts in brackets. */}}
{{- define "kvcache.listen" -}}
{{- $host := .Values.grpc.host -}}
{{- if contains ":" $host -}}
{{- $host = printf "[%s]" $host -}}
{{- end -}}
{{- printf "%s:%d" $host (int .Values.grpc.port) -}}
{{- end -}}

{{/* Where engines in the pod (sidecar mode) reach the service: the pod's loopback. */}}
{{- define "kvcache.localTarget" -}}
{{- printf "127.0.0.1:%d" (int .Values.grpc.port) -}}
{{- end -}}

{{/* Where the test pod and engines elsewhere in the namespace reach the service. */}}
{{- define "kvcache.serviceTarget" -}}
{{- printf "%s:%d" (include "kvcache.fullname" .) (int .Values.service.port) -}}
{{- end -}}

{{/* The auth Secret: the user's existing one, or the chart's when auth.token is set; "" without auth. */}}
{{- define "kvcache.authSecretName" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecret -}}
{{- else if .Values.auth.token -}}
{{- printf "%s-auth" (include "kvcache.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
TLS material: the Secrets' files in one projected volume named "tls" at tls.mountPath.
*/}}

{{/* The directory of the TLS files, without a trailing slash. */}}
{{- define "kvcache.tlsDir" -}}
{{- .Values.tls.mountPath | trimSuffix "/" -}}
{{- end -}}

{{/* The name the probes and the helm test pod check the server certificate against. */}}
{{- define "kvcache.tlsServerName" -}}
{{- .Values.tls.serverName | default (printf "%s.%s.svc" (include "kvcache.fullname" .) .Release.Namespace) -}}
{{- end -}}

{{/*
The "tls" volume. Call with (list $ true) for the service's pod: the server certificate and key, the CA
the probes trust and, with mutual TLS, the client CA; (list $ false) for the helm test pod: the CA, and
the server certificate and key only with mutual TLS (they are its client certificate). 0440 (288): the
pod's fsGroup reads them.
*/}}
{{- define "kvcache.tlsVolume" -}}
{{- $root := index . 0 -}}
{{- $forService := index . 1 -}}
{{- $tls := $root.Values.tls -}}
- name: tls
  projected:
    defaultMode: 288
    sources:
      {{- if or $forService $tls.clientCa.enabled }}
      - secret:
          name: {{ $tls.existingSecret }}
          items:
            - key: tls.crt
              path: tls.crt
            - key: tls.key
              path: tls.key
      {{- end }}
      - secret:
          name: {{ $tls.ca.existingSecret | default $tls.existingSecret }}
          items:
            - key: {{ $tls.ca.key }}
              path: ca.crt
      {{- if and $forService $tls.clientCa.enabled }}
      - secret:
          name: {{ $tls.clientCa.existingSecret | default $tls.existingSecret }}
          items:
            - key: {{ $tls.clientCa.key }}
              path: client-ca.crt
      {{- end }}
{{- end -}}

{{/* The read-only mount of the "tls" volume. */}}
{{- define "kvcache.tlsMount" -}}
- name: tls
  mountPath: {{ include "kvcache.tlsDir" . }}
  readOnly: true
{{- end -}}

{{/*
`kvcache-service health` options that reach the service over TLS, as YAML list items: trust the CA that
signed its certificate, check the certificate against tls.serverName, and with mutual TLS present the
server's own certificate and key as the client certificate.
*/}}
{{- define "kvcache.tlsHealthArgs" -}}
{{- $dir := include "kvcache.tlsDir" . -}}
- --tls-ca
- {{ printf "%s/ca.crt" $dir }}
- --tls-server-name
- {{ include "kvcache.tlsServerName" . }}
{{- if .Values.tls.clientCa.enabled }}
- --tls-cert
- {{ printf "%s/tls.crt" $dir }}
- --tls-key
- {{ printf "%s/tls.key" $dir }}
{{- end }}
{{- end -}}

{{/*
Pool sizing, mirroring cache_service/config.py, for the host_shm size check.
*/}}

{{/* The backend the service will pick: "auto" is cuda_vmm when the container gets a GPU (or cuda_ipc, where
the driver cannot export POSIX fds: the chart cannot tell), host_shm without one. */}}
{{- define "kvcache.effectiveBackend" -}}
{{- $backend := .Values.config.backend -}}
{{- if eq $backend "auto" -}}
{{- ternary "cuda_vmm" "host_shm" (gt (int .Values.gpu.count) 0) -}}
{{- else -}}
{{- $backend -}}
{{- end -}}
{{- end -}}

{{/*
A byte size as an integer string. Numbers pass through; strings follow config.parse_bytes ("512Mi",
"2G", "1.5Gi", "4096", optional trailing "B"; units are case-insensitive, k/M/G/T powers of 1000 and
Ki/Mi/Gi/Ti powers of 1024), which reads Kubernetes quantities of the forms the schema allows the
same way.
*/}}
{{- define "kvcache.bytes" -}}
{{- if or (kindIs "float64" .) (kindIs "int64" .) (kindIs "int" .) -}}
{{- int64 . -}}
{{- else -}}
{{- $text := . | trim | lower | trimSuffix "b" -}}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $text -}}
{{- $unit := trimPrefix $number $text | trim -}}
{{- $scale := get (dict "" 1 "k" 1000 "m" 1000000 "g" 1000000000 "t" 1000000000000 "ki" 1024 "mi" 1048576 "gi" 1073741824 "ti" 1099511627776) $unit -}}
{{- if or (not $number) (not $scale) -}}
{{- fail (printf "not a byte size: %q (use e.g. 512Mi, 2Gi, 1G or a plain number)" .) -}}
{{- end -}}
{{- mulf (float64 $number) $scale | floor | int64 -}}
{{- end -}}
{{- end -}}

{{/* Bytes of one page across all layers, K and V (MLA: one latent of headDim per token, its halves in K and V). */}}
{{- define "kvcache.pageBytes" -}}
{{- $c := .Values.config -}}
{{- $dtypeBytes := get (dict "float16" 2 "bfloat16" 2 "float32" 4 "float8_e4m3fn" 1 "float8_e5m2" 1) $c.dtype -}}
{{- $planes := ternary 1 2 (eq (toString $c.attention) "mla") -}}
{{- mul (int64 $c.numLayers) $planes (int64 $c.pageSize) (int64 $c.numKvHeads) (int64 $c.headDim) $dtypeBytes -}}
{{- end -}}

{{/* Bytes of the pool: numPages pages, else as many whole pages as poolBytes holds (with a model config, whose
page size the chart cannot read: poolBytes, an upper bound), else 1024 pages. */}}
{{- define "kvcache.poolBytes" -}}
{{- $pageBytes := include "kvcache.pageBytes" . | int64 -}}
{{- $poolBytes := include "kvcache.bytes" .Values.config.poolBytes | int64 -}}
{{- if and (or .Values.config.model .Values.modelConfig.configMap (gt (int64 .Values.config.windowPages) 0)) (gt $poolBytes 0) -}}
{{- /* the model's page size is unknown here (or window pages share poolBytes with the pages): at most poolBytes */ -}}
{{- $pageBytes = 1 -}}
{{- end -}}
{{- $numPages := int64 1024 -}}
{{- if gt (int64 .Values.config.numPages) 0 -}}
{{- $numPages = int64 .Values.config.numPages -}}
{{- else if gt $poolBytes 0 -}}
{{- $numPages = div $poolBytes $pageBytes -}}
{{- end -}}
{{- mul $pageBytes $numPages -}}
{{- end -}}

{{/*
Checks that span several values (the schema checks each value alone). Each failure names the values
and the fix.
*/}}
{{- define "kvcache.validate" -}}
{{- $v := .Values -}}
{{- if and (eq $v.mode "deployment") (ne (int $v.replicaCount) 1) -}}
{{- fail (printf "replicaCount=%d: mode=deployment runs one cache; use mode=sidecar to run a cache per engine pod, or mode=daemonset for one per node" (int $v.replicaCount)) -}}
{{- end -}}
{{- if and (eq $v.mode "sidecar") (not $v.sidecar.containers) -}}
{{- fail "mode=sidecar needs your engine containers in sidecar.containers" -}}
{{- end -}}
{{- if and (ne $v.mode "sidecar") $v.sidecar.containers -}}
{{- fail (printf "sidecar.containers is set but mode=%s: engine containers are rendered only with mode=sidecar" $v.mode) -}}
{{- end -}}
{{- if le (float64 $v.terminationGracePeriodSeconds) (float64 $v.config.gracePeriod) -}}
{{- fail (printf "terminationGracePeriodSeconds=%v must exceed config.gracePeriod=%v, or the pod is killed before it drains and unlinks its pool" $v.terminationGracePeriodSeconds $v.config.gracePeriod) -}}
{{- end -}}
{{- if eq (int64 $v.config.numPages) 1 -}}
{{- fail "config.numPages=1: use 0 (unset) or at least 2; page 0 is reserved" -}}
{{- end -}}
{{- if has $v.grpc.host (list "127.0.0.1" "localhost" "::1") -}}
{{- fail (printf "grpc.host=%s is loopback: kubelet's gRPC probes and the Service connect to the pod IP; use 0.0.0.0 or ::" $v.grpc.host) -}}
{{- end -}}
{{- $poolBytesSet := gt (include "kvcache.bytes" $v.config.poolBytes | int64) 0 -}}
{{- if and (gt (int64 $v.config.numPages) 0) $poolBytesSet -}}
{{- fail (printf "config.numPages=%d and config.poolBytes=%v: set one or the other" (int64 $v.config.numPages) $v.config.poolBytes) -}}
{{- end -}}
{{- if and $v.metrics.enabled (eq (int $v.metrics.port) (int $v.grpc.port)) -}}
{{- fail (printf "metrics.port=%d is also grpc.port: give them different ports" (int $v.metrics.port)) -}}
{{- end -}}
{{- if and $v.metrics.serviceMonitor.enabled (not $v.metrics.enabled) -}}
{{- fail "metrics.serviceMonitor.enabled needs metrics.enabled=true" -}}
{{- end -}}
{{- if and $v.auth.token $v.auth.existingSecret -}}
{{- fail "auth.token and auth.existingSecret are both set: keep one" -}}
{{- end -}}
{{- if and $v.auth.tenantsSecret (or $v.auth.token $v.auth.existingSecret) -}}
{{- fail "auth.tenantsSecret and a token (auth.token or auth.existingSecret) are both set: give the admin an entry in the tenants file instead" -}}
{{- end -}}
{{- if gt (float64 $v.config.leaseTtl) (float64 $v.config.maxLeaseTtl) -}}
{{- fail (printf "config.leaseTtl=%v is above config.maxLeaseTtl=%v" $v.config.leaseTtl $v.config.maxLeaseTtl) -}}
{{- end -}}
{{- if $v.kvEvents.enabled -}}
{{- $taken := list (int $v.grpc.port) -}}
{{- if $v.metrics.enabled }}{{ $taken = append $taken (int $v.metrics.port) }}{{ end -}}
{{- if or (has (int $v.kvEvents.port) $taken) (has (int $v.kvEvents.replayPort) $taken) (eq (int $v.kvEvents.port) (int $v.kvEvents.replayPort)) -}}
{{- fail (printf "kvEvents.port=%d and kvEvents.replayPort=%d must differ from each other and from grpc.port and metrics.port" (int $v.kvEvents.port) (int $v.kvEvents.replayPort)) -}}
{{- end -}}
{{- end -}}
{{- if and $v.tls.enabled (not $v.tls.existingSecret) -}}
{{- fail "tls.enabled needs tls.existingSecret: the name of a kubernetes.io/tls Secret with the server certificate (tls.crt) and key (tls.key)" -}}
{{- end -}}
{{- if and $v.tls.existingSecret (not $v.tls.enabled) -}}
{{- fail (printf "tls.existingSecret=%s is set but tls.enabled=false: the service would serve plaintext; set tls.enabled=true, or drop the Secret" $v.tls.existingSecret) -}}
{{- end -}}
{{- if and $v.tls.clientCa.enabled (not $v.tls.enabled) -}}
{{- fail "tls.clientCa.enabled (mutual TLS) needs tls.enabled=true and tls.existingSecret" -}}
{{- end -}}
{{- $backend := include "kvcache.effectiveBackend" . -}}
{{- $backendLabel := ternary (printf "auto (expected: %s)" $backend) $backend (eq $v.config.backend "auto") -}}
{{- if $v.poolSocket.hostPath -}}
{{- if not (has $backend (list "cuda_vmm" "host_memfd")) -}}
{{- fail (printf "poolSocket.hostPath=%s is set but backend=%s serves no pool socket: it is for cuda_vmm and host_memfd" $v.poolSocket.hostPath $backendLabel) -}}
{{- end -}}
{{- if or (not (hasPrefix "/" $v.config.poolSocket)) (eq (dir $v.config.poolSocket) "/") -}}
{{- fail (printf "poolSocket.hostPath=%s needs config.poolSocket, a socket path in the directory the node directory is mounted at (e.g. /run/kvcache/pool.sock); got %q" $v.poolSocket.hostPath $v.config.poolSocket) -}}
{{- end -}}
{{- end -}}
{{- if and $v.config.stepSocket (not $v.config.stepLane) -}}
{{- fail (printf "config.stepSocket=%s is set but config.stepLane is false: keep one" $v.config.stepSocket) -}}
{{- end -}}
{{- if $v.config.stepSocket -}}
{{- $laneDir := dir $v.config.stepSocket -}}
{{- if or (eq $laneDir "/") (eq $laneDir "/tmp") (eq $laneDir $v.config.shmDir) (and $v.poolSocket.hostPath (eq $laneDir (dir $v.config.poolSocket))) -}}
{{- fail (printf "config.stepSocket=%s needs a directory of its own (the chart mounts a volume there), not / , /tmp, config.shmDir or the pool socket's; e.g. /run/kvcache-lane/step.sock" $v.config.stepSocket) -}}
{{- end -}}
{{- if eq $v.mode "deployment" -}}
{{- fail (printf "config.stepSocket=%s serves engines in the service's pod (mode=sidecar) or on its node (mode=daemonset with stepSocket.hostPath); mode=deployment has neither: leave it empty, engines use gRPC" $v.config.stepSocket) -}}
{{- end -}}
{{- if and (eq $v.mode "daemonset") (not $v.stepSocket.hostPath) -}}
{{- fail (printf "config.stepSocket=%s in mode=daemonset needs stepSocket.hostPath (e.g. /run/kvcache-lane): engines in other pods reach the socket only through a node directory" $v.config.stepSocket) -}}
{{- end -}}
{{- else if $v.stepSocket.hostPath -}}
{{- fail (printf "stepSocket.hostPath=%s needs config.stepSocket, a socket path in the directory it is mounted at (e.g. /run/kvcache-lane/step.sock)" $v.stepSocket.hostPath) -}}
{{- end -}}
{{- if eq $v.mode "daemonset" -}}
{{- if and (eq $backend "cuda_ipc") (not $v.hostIPC) -}}
{{- fail (printf "backend=%s in mode=daemonset needs hostIPC=true: engines in other pods open a CUDA IPC handle only in the node's IPC namespace. Or use backend=cuda_vmm with poolSocket.hostPath, which needs no hostIPC" $backendLabel) -}}
{{- end -}}
{{- if and (has $backend (list "cuda_vmm" "host_memfd")) (not $v.poolSocket.hostPath) -}}
{{- fail (printf "backend=%s in mode=daemonset needs poolSocket.hostPath, with config.poolSocket in it (e.g. /run/kvcache and /run/kvcache/pool.sock): engines in other pods receive the pool over that socket, which otherwise stays inside the service's pod" $backendLabel) -}}
{{- end -}}
{{- end -}}
{{- $model := or $v.config.model $v.modelConfig.configMap -}}
{{- if and $v.config.model $v.modelConfig.configMap -}}
{{- fail (printf "config.model=%s and modelConfig.configMap=%s are both set: the ConfigMap sets --model; keep one" $v.config.model $v.modelConfig.configMap) -}}
{{- end -}}
{{- if and (gt (float64 $v.config.gpuMemoryFraction) 0.0) (or (gt (int64 $v.config.numPages) 0) $poolBytesSet) -}}
{{- fail "config.gpuMemoryFraction sizes the pool: leave config.numPages and config.poolBytes at 0" -}}
{{- end -}}
{{- if and (gt (float64 $v.config.gpuMemoryFraction) 0.0) (not (has $backend (list "cuda_vmm" "cuda_ipc"))) -}}
{{- fail (printf "config.gpuMemoryFraction sizes a GPU pool, not backend=%s: use config.poolBytes" $backendLabel) -}}
{{- end -}}
{{- if and $model (has $backend (list "host_shm" "host_memfd")) (not $poolBytesSet) -}}
{{- fail (printf "a model config (config.model or modelConfig.configMap) with backend=%s needs config.poolBytes: the chart cannot read the model's layout to size the pool's memory" $backendLabel) -}}
{{- end -}}
{{- include "kvcache.validateTier" . -}}
{{- if and (eq $backend "host_shm") (not $v.shm.hostPath) -}}
{{- $poolBytes := include "kvcache.poolBytes" . | int64 -}}
{{- $limitBytes := include "kvcache.bytes" $v.shm.sizeLimit | int64 -}}
{{- if gt $poolBytes $limitBytes -}}
{{- fail (printf "shm.sizeLimit=%v (%d bytes) cannot hold the host_shm pool of %d bytes (config.numLayers*2*pageSize*numKvHeads*headDim*dtype bytes*pages): raise shm.sizeLimit or shrink the pool" $v.shm.sizeLimit $limitBytes $poolBytes) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The tier's cross-value checks (config.tier, its flags and tierVolume). */}}
{{- define "kvcache.validateTier" -}}
{{- $v := .Values -}}
{{- $c := $v.config -}}
{{- $t := $v.tierVolume -}}
{{- if eq $c.tier "disk" -}}
{{- if not $c.tierDir -}}
{{- fail "config.tier=disk needs config.tierDir, the directory the chart mounts tierVolume at (e.g. /var/lib/kvcache/tier)" -}}
{{- end -}}
{{- if and $t.existingClaim $t.hostPath -}}
{{- fail (printf "tierVolume.existingClaim=%s and tierVolume.hostPath=%s are both set: keep one" $t.existingClaim $t.hostPath) -}}
{{- end -}}
{{- if and (eq $v.mode "daemonset") $t.existingClaim -}}
{{- fail (printf "tierVolume.existingClaim=%s in mode=daemonset: one claim cannot serve a pod on every node; use tierVolume.hostPath" $t.existingClaim) -}}
{{- end -}}
{{- if and (gt (int $v.replicaCount) 1) (or $t.existingClaim $t.hostPath) (ne $v.mode "daemonset") -}}
{{- fail (printf "replicaCount=%d with a shared tierVolume: each service needs its own tier directory (one service per directory); use one replica, or the emptyDir" (int $v.replicaCount)) -}}
{{- end -}}
{{- if not (or $t.existingClaim $t.hostPath) -}}
{{- $tierBytes := include "kvcache.bytes" $c.tierBytes | int64 -}}
{{- $limitBytes := include "kvcache.bytes" $t.sizeLimit | int64 -}}
{{- if or (eq $tierBytes 0) (gt $tierBytes $limitBytes) -}}
{{- fail (printf "config.tierBytes=%v must be set within tierVolume.sizeLimit=%v with the emptyDir (the default of half the free space is the node's disk, not the limit)" $c.tierBytes $t.sizeLimit) -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- if $c.tierDir -}}
{{- fail (printf "config.tierDir=%s is set but config.tier=%s: the disk tier needs config.tier=disk" $c.tierDir $c.tier) -}}
{{- end -}}
{{- if gt (include "kvcache.bytes" $c.tierBytes | int64) 0 -}}
{{- fail (printf "config.tierBytes=%v is set but config.tier=%s: it sizes the disk tier" $c.tierBytes $c.tier) -}}
{{- end -}}
{{- if or $t.existingClaim $t.hostPath -}}
{{- fail (printf "tierVolume is set but config.tier=%s: it holds the disk tier (config.tier=disk)" $c.tier) -}}
{{- end -}}
{{- end -}}
{{- if and (eq $c.tier "mooncake") (not $c.mooncakeMaster) -}}
{{- fail "config.tier=mooncake needs config.mooncakeMaster, the Mooncake master's host:port" -}}
{{- end -}}
{{- if and $c.mooncakeMaster (ne $c.tier "mooncake") -}}
{{- fail (printf "config.mooncakeMaster=%s is set but config.tier=%s: set config.tier=mooncake" $c.mooncakeMaster $c.tier) -}}
{{- end -}}
{{- $segment := include "kvcache.bytes" $c.mooncakeSegmentBytes | int64 -}}
{{- if and (gt $segment 0) (lt $segment 16777216) -}}
{{- fail (printf "config.mooncakeSegmentBytes=%v: 0 or at least 16Mi (Mooncake refuses smaller segments)" $c.mooncakeSegmentBytes) -}}
{{- end -}}
{{- end -}}

{{/*
Serve flags as env vars: config.<camelCase> -> KVCACHE_<SNAKE_CASE>, then the flags other values own. With a
model config (config.model or modelConfig.configMap) the layout values stay out: --model sets them.
Whole numbers render as integers (Helm holds every number as a float64, and "1.048576e+06" is no
--max-request-tokens).
*/}}
{{- define "kvcache.env" -}}
{{- $model := or .Values.config.model .Values.modelConfig.configMap -}}
{{- range $key, $value := omit .Values.config "mooncakeLocalHostname" }}
{{- if not (or (and (eq $key "model") $.Values.modelConfig.configMap) (and $model (has $key (list "attention" "numLayers" "numKvHeads" "headDim" "slidingWindow" "windowLayers" "dtype")))) }}
- name: {{ printf "KVCACHE_%s" ($key | snakecase | upper) }}
  {{- if and (eq $key "stepLane") (eq $.Values.mode "deployment") }}
  value: "false"
  {{- else if and (kindIs "float64" $value) (eq $value (floor $value)) }}
  value: {{ int64 $value | quote }}
  {{- else }}
  value: {{ toString $value | quote }}
  {{- end }}
{{- end }}
{{- end }}
{{- with .Values.modelConfig.configMap }}
- name: KVCACHE_MODEL
  value: {{ printf "%s/%s" ($.Values.modelConfig.mountPath | trimSuffix "/") $.Values.modelConfig.key | quote }}
{{- end }}
- name: KVCACHE_MOONCAKE_LOCAL_HOSTNAME
  {{- with .Values.config.mooncakeLocalHostname }}
  value: {{ . | quote }}
  {{- else }}
  {{- /* The address Mooncake's transfer engine announces: the pod's own, which the storage nodes reach. */}}
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
  {{- end }}
- name: KVCACHE_LISTEN
  value: {{ include "kvcache.listen" . | quote }}
- name: KVCACHE_METRICS_PORT
  value: {{ ternary (int .Values.metrics.port) "off" .Values.metrics.enabled | quote }}
- name: KVCACHE_METRICS_HOST
  value: {{ .Values.metrics.host | quote }}
{{- with include "kvcache.authSecretName" . }}
- name: KVCACHE_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ ternary $.Values.auth.existingSecretKey "token" (not (empty $.Values.auth.existingSecret)) }}
{{- end }}
{{- if .Values.kvEvents.enabled }}
- name: KVCACHE_KV_EVENTS_ENDPOINT
  value: {{ printf "tcp://%s:%d" (include "kvcache.bindHost" .Values.kvEvents.host) (int .Values.kvEvents.port) | quote }}
- name: KVCACHE_KV_EVENTS_REPLAY_ENDPOINT
  value: {{ printf "tcp://%s:%d" (include "kvcache.bindHost" .Values.kvEvents.host) (int .Values.kvEvents.replayPort) | quote }}
{{- end }}
{{- with .Values.auth.tenantsSecret }}
- name: KVCACHE_TENANTS_FILE
  value: {{ printf "%s/%s" ($.Values.auth.tenantsMountPath | trimSuffix "/") $.Values.auth.tenantsSecretKey | quote }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: KVCACHE_TLS_CERT
  value: {{ printf "%s/tls.crt" (include "kvcache.tlsDir" .) | quote }}
- name: KVCACHE_TLS_KEY
  value: {{ printf "%s/tls.key" (include "kvcache.tlsDir" .) | quote }}
{{- if .Values.tls.clientCa.enabled }}
- name: KVCACHE_TLS_CLIENT_CA
  value: {{ printf "%s/client-ca.crt" (include "kvcache.tlsDir" .) | quote }}
{{- end }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
One probe of grpc.health.v1 on the gRPC port. Call with (list $ "liveness"). Native gRPC probes speak
plaintext only: with TLS it is an exec probe running `kvcache-service health` over TLS against the pod's
loopback, with an RPC deadline a second shorter than the probe's timeout (at least one second), so that a
slow answer fails with the command's own reason.
*/}}
{{- define "kvcache.probe" -}}
{{- $root := index . 0 -}}
{{- $probe := index $root.Values.probes (index . 1) -}}
{{- if $root.Values.tls.enabled -}}
exec:
  command:
    - kvcache-service
    - health
    - --target
    - {{ include "kvcache.localTarget" $root }}
    {{- with $probe.service }}
    - --service
    - {{ . }}
    {{- end }}
    - --timeout
    - {{ max 1 (sub (int $probe.timeoutSeconds) 1) | quote }}
    {{- include "kvcache.tlsHealthArgs" $root | nindent 4 }}
{{- else -}}
grpc:
  port: {{ int $root.Values.grpc.port }}
  service: {{ $probe.service | quote }}
{{- end }}
periodSeconds: {{ int $probe.periodSeconds }}
timeoutSeconds: {{ int $probe.timeoutSeconds }}
failureThreshold: {{ int $probe.failureThreshold }}
{{- end -}}

{{/* The service container's resources: .Values.resources plus gpu.count GPUs as requests and limits. */}}
{{- define "kvcache.resources" -}}
{{- $resources := deepCopy .Values.resources -}}
{{- if gt (int .Values.gpu.count) 0 -}}
{{- range $kind := list "requests" "limits" -}}
{{- $section := get $resources $kind | default dict -}}
{{- $_ := set $section $.Values.gpu.resourceName (int $.Values.gpu.count) -}}
{{- $_ := set $resources $kind $section -}}
{{- end -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{/* The kvcache container. */}}
{{- define "kvcache.container" -}}
name: kvcache
image: {{ include "kvcache.image" . | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- if and (eq .Values.mode "sidecar") .Values.sidecar.nativeSidecar }}
restartPolicy: Always
{{- end }}
ports:
  - name: grpc
    containerPort: {{ int .Values.grpc.port }}
    protocol: TCP
  {{- if .Values.metrics.enabled }}
  - name: metrics
    containerPort: {{ int .Values.metrics.port }}
    protocol: TCP
  {{- end }}
  {{- if .Values.kvEvents.enabled }}
  - name: kv-events
    containerPort: {{ int .Values.kvEvents.port }}
    protocol: TCP
  - name: kv-replay
    containerPort: {{ int .Values.kvEvents.replayPort }}
    protocol: TCP
  {{- end }}
env:
  {{- include "kvcache.env" . | trim | nindent 2 }}
{{- if .Values.probes.startup.enabled }}
startupProbe:
  {{- include "kvcache.probe" (list . "startup") | nindent 2 }}
{{- end }}
{{- if .Values.probes.liveness.enabled }}
livenessProbe:
  {{- include "kvcache.probe" (list . "liveness") | nindent 2 }}
{{- end }}
{{- if .Values.probes.readiness.enabled }}
readinessProbe:
  {{- include "kvcache.probe" (list . "readiness") | nindent 2 }}
{{- end }}
resources:
  {{- include "kvcache.resources" . | nindent 2 }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
volumeMounts:
  - name: shm
    mountPath: {{ .Values.config.shmDir }}
  - name: tmp
    mountPath: /tmp
  {{- if .Values.poolSocket.hostPath }}
  - name: pool-socket
    mountPath: {{ dir .Values.config.poolSocket }}
  {{- end }}
  {{- if .Values.config.stepSocket }}
  - name: step-socket
    mountPath: {{ dir .Values.config.stepSocket }}
  {{- end }}
  {{- if eq .Values.config.tier "disk" }}
  - name: tier
    mountPath: {{ .Values.config.tierDir }}
  {{- end }}
  {{- if .Values.tls.enabled }}
  {{- include "kvcache.tlsMount" . | nindent 2 }}
  {{- end }}
  {{- if .Values.modelConfig.configMap }}
  - name: model-config
    mountPath: {{ .Values.modelConfig.mountPath | trimSuffix "/" }}
    readOnly: true
  {{- end }}
  {{- if .Values.auth.tenantsSecret }}
  - name: tenants
    mountPath: {{ .Values.auth.tenantsMountPath | trimSuffix "/" }}
    readOnly: true
  {{- end }}
  {{- with .Values.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/*
Sidecar engine containers as a YAML list: the user's specs, plus the shm volume at config.shmDir, the
pool-socket volume (with poolSocket.hostPath), the step-socket volume (with config.stepSocket) and
KVCACHE_TARGET where the spec does not already set them.
*/}}
{{- define "kvcache.engineContainers" -}}
{{- $engines := list -}}
{{- range .Values.sidecar.containers -}}
{{- $engine := deepCopy . -}}
{{- $mounts := $engine.volumeMounts | default list -}}
{{- $hasShm := false -}}
{{- range $mounts -}}
{{- if or (eq .name "shm") (eq .mountPath $.Values.config.shmDir) -}}
{{- $hasShm = true -}}
{{- end -}}
{{- end -}}
{{- if not $hasShm -}}
{{- $mounts = append $mounts (dict "name" "shm" "mountPath" $.Values.config.shmDir) -}}
{{- end -}}
{{- if $.Values.poolSocket.hostPath -}}
{{- $socketDir := dir $.Values.config.poolSocket -}}
{{- $hasSocket := false -}}
{{- range $mounts -}}
{{- if or (eq .name "pool-socket") (eq .mountPath $socketDir) -}}
{{- $hasSocket = true -}}
{{- end -}}
{{- end -}}
{{- if not $hasSocket -}}
{{- $mounts = append $mounts (dict "name" "pool-socket" "mountPath" $socketDir) -}}
{{- end -}}
{{- end -}}
{{- if $.Values.config.stepSocket -}}
{{- $laneDir := dir $.Values.config.stepSocket -}}
{{- $hasLane := false -}}
{{- range $mounts -}}
{{- if or (eq .name "step-socket") (eq .mountPath $laneDir) -}}
{{- $hasLane = true -}}
{{- end -}}
{{- end -}}
{{- if not $hasLane -}}
{{- $mounts = append $mounts (dict "name" "step-socket" "mountPath" $laneDir) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $engine "volumeMounts" $mounts -}}
{{- $env := $engine.env | default list -}}
{{- $hasTarget := false -}}
{{- range $env -}}
{{- if eq .name "KVCACHE_TARGET" -}}
{{- $hasTarget = true -}}
{{- end -}}
{{- end -}}
{{- if not $hasTarget -}}
{{- $env = append $env (dict "name" "KVCACHE_TARGET" "value" (include "kvcache.localTarget" $)) -}}
{{- end -}}
{{- $_ := set $engine "env" $env -}}
{{- $engines = append $engines $engine -}}
{{- end -}}
{{- toYaml $engines -}}
{{- end -}}

{{/* The pod template shared by the Deployment and the DaemonSet. */}}
{{- define "kvcache.podTemplate" -}}
{{- $sidecar := eq .Values.mode "sidecar" -}}
metadata:
  labels:
    {{- include "kvcache.labels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- $annotations := deepCopy .Values.podAnnotations }}
  {{- if .Values.auth.token }}
  {{- /* Restart pods when the chart's token changes: env from a Secret is read only at start. */}}
  {{- $_ := set $annotations "checksum/auth" (.Values.auth.token | sha256sum) }}
  {{- end }}
  {{- with $annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "kvcache.serviceAccountName" . }}
  automountServiceAccountToken: false
  # The chart's Service would otherwise inject KVCACHE_SERVICE_HOST-style variables into the
  # KVCACHE_* namespace the service reads its flags from.
  enableServiceLinks: false
  hostIPC: {{ .Values.hostIPC }}
  terminationGracePeriodSeconds: {{ int .Values.terminationGracePeriodSeconds }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with .Values.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.resourceClaims }}
  resourceClaims:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if and $sidecar .Values.sidecar.nativeSidecar }}
  initContainers:
    - {{ include "kvcache.container" . | nindent 6 | trim }}
  containers:
    {{- include "kvcache.engineContainers" . | nindent 4 }}
  {{- else }}
  containers:
    - {{ include "kvcache.container" . | nindent 6 | trim }}
    {{- if $sidecar }}
    {{- include "kvcache.engineContainers" . | nindent 4 }}
    {{- end }}
  {{- end }}
  volumes:
    - name: shm
      {{- if .Values.shm.hostPath }}
      hostPath:
        path: {{ .Values.shm.hostPath }}
        type: Directory
      {{- else }}
      emptyDir:
        medium: Memory
        sizeLimit: {{ .Values.shm.sizeLimit }}
      {{- end }}
    - name: tmp
      emptyDir:
        sizeLimit: 64Mi
    {{- with .Values.poolSocket.hostPath }}
    - name: pool-socket
      hostPath:
        path: {{ . }}
        type: DirectoryOrCreate
    {{- end }}
    {{- if .Values.config.stepSocket }}
    - name: step-socket
      {{- with .Values.stepSocket.hostPath }}
      hostPath:
        path: {{ . }}
        type: DirectoryOrCreate
      {{- else }}
      emptyDir:
        sizeLimit: 1Mi
      {{- end }}
    {{- end }}
    {{- if eq .Values.config.tier "disk" }}
    - name: tier
      {{- if .Values.tierVolume.existingClaim }}
      persistentVolumeClaim:
        claimName: {{ .Values.tierVolume.existingClaim }}
      {{- else if .Values.tierVolume.hostPath }}
      hostPath:
        path: {{ .Values.tierVolume.hostPath }}
        type: DirectoryOrCreate
      {{- else }}
      emptyDir:
        sizeLimit: {{ .Values.tierVolume.sizeLimit }}
      {{- end }}
    {{- end }}
    {{- if .Values.tls.enabled }}
    {{- include "kvcache.tlsVolume" (list . true) | nindent 4 }}
    {{- end }}
    {{- with .Values.modelConfig.configMap }}
    - name: model-config
      configMap:
        name: {{ . }}
        items:
          - key: {{ $.Values.modelConfig.key }}
            path: {{ $.Values.modelConfig.key }}
    {{- end }}
    {{- with .Values.auth.tenantsSecret }}
    - name: tenants
      secret:
        secretName: {{ . }}
        items:
          - key: {{ $.Values.auth.tenantsSecretKey }}
            path: {{ $.Values.auth.tenantsSecretKey }}
    {{- end }}
    {{- with .Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* A host for a ZMQ tcp:// address: IPv6 literals in brackets. */}}
{{- define "kvcache.bindHost" -}}
{{- if contains ":" . -}}[{{ . }}]{{- else -}}{{ . }}{{- end -}}
{{- end -}}
