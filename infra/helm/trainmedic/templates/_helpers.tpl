{{/*
Chart name, truncated to 63 characters (the DNS label limit of some name fields).
*/}}
{{- define "trainmedic.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: the release name, plus the chart name unless it already contains it.
*/}}
{{- define "trainmedic.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "trainmedic.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels. Call with (dict "root" $ "component" "streams").
*/}}
{{- define "trainmedic.labels" -}}
helm.sh/chart: {{ include "trainmedic.chart" .root }}
{{ include "trainmedic.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/*
Selector labels (immutable once deployed). Call with (dict "root" $ "component" "streams").
*/}}
{{- define "trainmedic.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trainmedic.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{- define "trainmedic.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "trainmedic.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The server image and the node image; both tagged with the chart's appVersion by default. */}}
{{- define "trainmedic.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "trainmedic.nodeImage" -}}
{{- printf "%s:%s" .Values.nodeImage.repository (default .Chart.AppVersion .Values.nodeImage.tag) }}
{{- end }}

{{- define "trainmedic.nodeMapConfigMap" -}}
{{- printf "%s-node-map" (include "trainmedic.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "trainmedic.policyConfigMap" -}}
{{- printf "%s-policy" (include "trainmedic.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Pod metadata every component shares. Call with (dict "root" $ "component" "streams").
*/}}
{{- define "trainmedic.podMetadata" -}}
labels:
  {{- include "trainmedic.labels" . | nindent 2 }}
  {{- with .root.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .root.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "trainmedic.podCommon" -}}
serviceAccountName: {{ include "trainmedic.serviceAccountName" . }}
{{ include "trainmedic.podCommonNoAccount" . }}
{{- end }}

{{/*
The hook Jobs run before the release's own objects exist, the ServiceAccount included: they use
the namespace's default account (no token mounted either way).
*/}}
{{- define "trainmedic.podCommonNoAccount" -}}
automountServiceAccountToken: {{ .Values.serviceAccount.automount }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Scheduling fields of a component's values (nodeSelector, tolerations, affinity); empty when none.
Callers wrap it in a with, so that nothing is written when it is empty.
*/}}
{{- define "trainmedic.scheduling" -}}
{{- $out := dict }}
{{- with .nodeSelector }}{{ $_ := set $out "nodeSelector" . }}{{ end }}
{{- with .tolerations }}{{ $_ := set $out "tolerations" . }}{{ end }}
{{- with .affinity }}{{ $_ := set $out "affinity" . }}{{ end }}
{{- if $out }}{{ toYaml $out }}{{ end }}
{{- end }}

{{/*
Environment every process gets: Kafka (bootstrap and client security, the SASL user of its own
credential), the cluster's name. Call with (dict "root" $ "as" "streams"): `as` names the
component's entry of kafka.sasl.credentials; "" for a process without Kafka access (migrate),
which gets no Kafka security at all (its settings then need none).
*/}}
{{- define "trainmedic.commonEnv" -}}
{{- $v := .root.Values -}}
- name: TRAINMEDIC_BOOTSTRAP
  value: {{ $v.kafka.bootstrap | quote }}
- name: TRAINMEDIC_TOPIC_PARTITIONS
  value: {{ $v.topics.partitions | quote }}
- name: TRAINMEDIC_CLUSTER
  value: {{ $v.cluster | quote }}
{{- if .as }}
- name: TRAINMEDIC_KAFKA_SECURITY_PROTOCOL
  value: {{ $v.kafka.securityProtocol | quote }}
{{- if hasPrefix "sasl_" $v.kafka.securityProtocol }}
{{- $cred := include "trainmedic.kafkaCredential" . | fromYaml }}
- name: TRAINMEDIC_KAFKA_SASL_MECHANISM
  value: {{ $v.kafka.sasl.mechanism | quote }}
- name: TRAINMEDIC_KAFKA_SASL_USERNAME
  value: {{ $cred.username | quote }}
- name: TRAINMEDIC_KAFKA_SASL_PASSWORD_FILE
  value: /etc/trainmedic/kafka-sasl/password
{{- end }}
{{- if and (hasSuffix "ssl" $v.kafka.securityProtocol) $v.kafka.tls.existingSecret }}
- name: TRAINMEDIC_KAFKA_SSL_CA
  value: /etc/trainmedic/kafka-tls/ca.crt
{{- if $v.kafka.tls.certificateKey }}
- name: TRAINMEDIC_KAFKA_SSL_CERTIFICATE
  value: /etc/trainmedic/kafka-tls/client.crt
- name: TRAINMEDIC_KAFKA_SSL_KEY
  value: /etc/trainmedic/kafka-tls/client.key
{{- end }}
{{- end }}
{{- end }}
- name: PYTHONUNBUFFERED
  value: "1"
{{- end }}

{{/* One component's Kafka credential (dict "root" $ "as" "gpu"), as YAML; fails when missing. */}}
{{- define "trainmedic.kafkaCredential" -}}
{{- $cred := index .root.Values.kafka.sasl.credentials .as | default dict -}}
{{- if not (and $cred.username $cred.existingSecret) -}}
{{- fail (printf "kafka.sasl.credentials.%s: username and existingSecret are required with securityProtocol %s (one principal per component: docs/security.md)" .as .root.Values.kafka.securityProtocol) -}}
{{- end -}}
{{- toYaml $cred }}
{{- end }}

{{/* The Kafka mounts of one container (dict "root" $ "as" "streams"): its own SASL password, the TLS files. */}}
{{- define "trainmedic.kafkaMounts" -}}
{{- $v := .root.Values -}}
{{- if and (hasPrefix "sasl_" $v.kafka.securityProtocol) .as }}
- name: kafka-sasl-{{ .as | kebabcase }}
  mountPath: /etc/trainmedic/kafka-sasl
  readOnly: true
{{- end }}
{{- if and .as (hasSuffix "ssl" $v.kafka.securityProtocol) $v.kafka.tls.existingSecret }}
- name: kafka-tls
  mountPath: /etc/trainmedic/kafka-tls
  readOnly: true
{{- end }}
{{- end }}

{{/*
The Kafka volumes of one pod (dict "root" $ "as" (list "gpu" "kernel")): a Secret volume per
component credential its containers use (each container mounts only its own), and the TLS files.
*/}}
{{- define "trainmedic.kafkaVolumes" -}}
{{- $v := .root.Values -}}
{{- if hasPrefix "sasl_" $v.kafka.securityProtocol }}
{{- range $as := .as }}
{{- $cred := include "trainmedic.kafkaCredential" (dict "root" $.root "as" $as) | fromYaml }}
- name: kafka-sasl-{{ $as | kebabcase }}
  secret:
    secretName: {{ $cred.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ $cred.passwordKey | default $v.kafka.sasl.passwordKey }}
        path: password
{{- end }}
{{- end }}
{{- with $v.kafka.tls }}
{{- if and $.as (hasSuffix "ssl" $v.kafka.securityProtocol) .existingSecret }}
- name: kafka-tls
  secret:
    secretName: {{ .existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .caKey }}
        path: ca.crt
      {{- if .certificateKey }}
      - key: {{ .certificateKey }}
        path: client.crt
      - key: {{ .keyKey }}
        path: client.key
      {{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The site secret (streams, ingest): env, mount, volume; nothing when siteSecret.existingSecret is empty.
*/}}
{{- define "trainmedic.siteSecretEnv" -}}
{{- if .Values.siteSecret.existingSecret }}
- name: TRAINMEDIC_SITE_SECRET_FILE
  value: /etc/trainmedic/site-secret/site-secret
{{- end }}
{{- end }}

{{- define "trainmedic.siteSecretMount" -}}
{{- if .Values.siteSecret.existingSecret }}
- name: site-secret
  mountPath: /etc/trainmedic/site-secret
  readOnly: true
{{- end }}
{{- end }}

{{- define "trainmedic.siteSecretVolume" -}}
{{- if .Values.siteSecret.existingSecret }}
- name: site-secret
  secret:
    secretName: {{ .Values.siteSecret.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.siteSecret.key }}
        path: site-secret
{{- end }}
{{- end }}

{{/* This node's signing key (gpu, ib, kernel containers): env and mount; nothing without nodeKey.hostPath. */}}
{{- define "trainmedic.nodeKeyEnv" -}}
{{- if .Values.nodeProducers.nodeKey.hostPath }}
- name: TRAINMEDIC_NODE_KEY_FILE
  value: /etc/trainmedic/node-key/node-key
{{- end }}
{{- end }}

{{- define "trainmedic.nodeKeyMount" -}}
{{- if .Values.nodeProducers.nodeKey.hostPath }}
- name: node-key
  mountPath: /etc/trainmedic/node-key/node-key
  readOnly: true
{{- end }}
{{- end }}

{{/*
The probe listener of one container: its env (dict "port" 9479), its probes on the named
port (dict "root" $ "portName" "metrics").
*/}}
{{- define "trainmedic.metricsEnv" -}}
- name: TRAINMEDIC_METRICS_HOST
  value: "0.0.0.0"
- name: TRAINMEDIC_METRICS_PORT
  value: {{ .port | quote }}
{{- end }}

{{- define "trainmedic.probes" -}}
{{- $probes := .root.Values.probes -}}
startupProbe:
  {{- toYaml (merge (dict "httpGet" (dict "path" "/healthz" "port" .portName)) $probes.startup) | nindent 2 }}
readinessProbe:
  {{- toYaml (merge (dict "httpGet" (dict "path" "/readyz" "port" .portName)) $probes.readiness) | nindent 2 }}
livenessProbe:
  {{- toYaml (merge (dict "httpGet" (dict "path" "/healthz" "port" .portName)) $probes.liveness) | nindent 2 }}
{{- end }}

{{/*
What the processes write: their working directory /var/lib/trainmedic (producer positions under
var/, the streams worker's table store, the API's modes file) and /tmp are emptyDirs, so the
root filesystem stays read-only.
*/}}
{{- define "trainmedic.scratchMounts" -}}
- name: work
  mountPath: /var/lib/trainmedic
- name: tmp
  mountPath: /tmp
{{- end }}

{{- define "trainmedic.scratchVolumes" -}}
- name: work
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "trainmedic.policyEnv" -}}
- name: TRAINMEDIC_POLICY
  value: /etc/trainmedic/policy/policy.yaml
{{- end }}

{{/* Mounted as a directory (not subPath) so that ConfigMap updates reach the running pod. */}}
{{- define "trainmedic.policyMount" -}}
- name: policy
  mountPath: /etc/trainmedic/policy
  readOnly: true
{{- end }}

{{- define "trainmedic.policyVolume" -}}
- name: policy
  configMap:
    name: {{ include "trainmedic.policyConfigMap" . }}
{{- end }}

{{/*
ClickHouse (audit sink, migration, API): the URL from the Secret, as a file.
*/}}
{{- define "trainmedic.clickhouseEnv" -}}
- name: TRAINMEDIC_CLICKHOUSE_URL_FILE
  value: /etc/trainmedic/clickhouse/url
{{- with .Values.clickhouse.userKey }}
- name: TRAINMEDIC_CLICKHOUSE_USER
  valueFrom:
    secretKeyRef:
      name: {{ $.Values.clickhouse.existingSecret }}
      key: {{ . }}
{{- end }}
{{- if .Values.clickhouse.passwordKey }}
- name: TRAINMEDIC_CLICKHOUSE_PASSWORD_FILE
  value: /etc/trainmedic/clickhouse/password
{{- end }}
{{- end }}

{{- define "trainmedic.clickhouseMount" -}}
- name: clickhouse
  mountPath: /etc/trainmedic/clickhouse
  readOnly: true
{{- end }}

{{- define "trainmedic.clickhouseVolume" -}}
- name: clickhouse
  secret:
    secretName: {{ .Values.clickhouse.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.clickhouse.urlKey }}
        path: url
      {{- with .Values.clickhouse.passwordKey }}
      - key: {{ . }}
        path: password
      {{- end }}
{{- end }}

{{/*
Slurm access (executor, API, Slurm producer): environment, mounts and volumes for slurm.access.
*/}}
{{- define "trainmedic.slurmEnv" -}}
- name: TRAINMEDIC_SLURM_ACCESS
  value: {{ .Values.slurm.access }}
{{- if eq .Values.slurm.access "ssh" }}
{{- with .Values.slurm.ssh }}
- name: TRAINMEDIC_SLURM_SSH_HOST
  value: {{ .host | quote }}
- name: TRAINMEDIC_SLURM_SSH_PORT
  value: {{ .port | quote }}
- name: TRAINMEDIC_SLURM_SSH_USER
  value: {{ .user | quote }}
- name: TRAINMEDIC_SLURM_SSH_KEY
  value: /etc/trainmedic/ssh/id
- name: TRAINMEDIC_SLURM_SSH_KNOWN_HOSTS
  value: /etc/trainmedic/ssh/known_hosts
{{- if .passphraseKey }}
- name: TRAINMEDIC_SLURM_SSH_PASSPHRASE_FILE
  value: /etc/trainmedic/ssh/passphrase
{{- end }}
{{- with .slurmConf }}
- name: TRAINMEDIC_SLURM_SSH_SLURM_CONF
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- else if eq .Values.slurm.access "rest" }}
- name: TRAINMEDIC_SLURMRESTD_URL
  value: {{ .Values.slurm.rest.url | quote }}
{{- with .Values.slurm.rest.user }}
- name: TRAINMEDIC_SLURMRESTD_USER
  value: {{ . | quote }}
{{- end }}
- name: TRAINMEDIC_SLURMRESTD_TOKEN_FILE
  value: /etc/trainmedic/slurmrestd/token
{{- else }}
- name: SLURM_CONF
  value: {{ .Values.slurm.local.slurmConf | quote }}
{{- end }}
{{- end }}

{{- define "trainmedic.slurmMounts" -}}
{{- if eq .Values.slurm.access "ssh" }}
- name: ssh
  mountPath: /etc/trainmedic/ssh
  readOnly: true
{{- else if eq .Values.slurm.access "rest" }}
- name: slurmrestd
  mountPath: /etc/trainmedic/slurmrestd
  readOnly: true
{{- else }}
{{- with .Values.slurm.local.volumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The SSH key is mounted 0440 and owned by root:fsGroup: readable by the pod's user, and OpenSSH
accepts it because the file is not owned by that user.
*/}}
{{- define "trainmedic.slurmVolumes" -}}
{{- if eq .Values.slurm.access "ssh" }}
- name: ssh
  secret:
    secretName: {{ .Values.slurm.ssh.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.slurm.ssh.privateKeyKey }}
        path: id
      - key: {{ .Values.slurm.ssh.knownHostsKey }}
        path: known_hosts
      {{- with .Values.slurm.ssh.passphraseKey }}
      - key: {{ . }}
        path: passphrase
      {{- end }}
{{- else if eq .Values.slurm.access "rest" }}
- name: slurmrestd
  secret:
    secretName: {{ .Values.slurm.rest.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.slurm.rest.tokenKey }}
        path: token
{{- else }}
{{- with .Values.slurm.local.volumes }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A kubernetes.io/tls Secret mounted as files (API, ingest). Call with (dict "name" "api-tls" "tls" .Values.api.tls).
*/}}
{{- define "trainmedic.tlsVolume" -}}
- name: {{ .name }}
  secret:
    secretName: {{ .tls.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .tls.certKey }}
        path: tls.crt
      - key: {{ .tls.keyKey }}
        path: tls.key
{{- end }}

{{/*
The Slurm node name of the node producers (nodeProducers.nodeName): the Kubernetes node's name
from the downward API, or nothing (the process takes the host's name); then the settings'
node_map (from the node-map ConfigMap) and node_strip_domain. HOST_IP is the node's IP for
$(HOST_IP) in the dcgm-exporter URL.
*/}}
{{- define "trainmedic.nodeEnv" -}}
{{- with .Values.nodeProducers.nodeName }}
{{- if eq .from "kubernetes" }}
- name: TRAINMEDIC_NODE
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end }}
{{- if .map }}
- name: TRAINMEDIC_NODE_MAP
  valueFrom:
    configMapKeyRef:
      name: {{ include "trainmedic.nodeMapConfigMap" $ }}
      key: node-map.json
{{- end }}
{{- if .stripDomain }}
- name: TRAINMEDIC_NODE_STRIP_DOMAIN
  value: "true"
{{- end }}
{{- end }}
- name: HOST_IP
  valueFrom:
    fieldRef:
      fieldPath: status.hostIP
{{- end }}

{{/* Extra values env and args of a component, appended (nothing when empty). */}}
{{- define "trainmedic.extraEnv" -}}
{{- with .env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Whether the audit schema is needed (audit sink or API): "true" or "". */}}
{{- define "trainmedic.needsAudit" -}}
{{- if or .Values.auditSink.enabled .Values.api.enabled }}true{{ end }}
{{- end }}

{{/*
The long-running workloads and their metrics port names, as YAML (component: [port names]):
what the PodMonitors scrape, the NetworkPolicies admit and the PodDisruptionBudgets cover.
*/}}
{{- define "trainmedic.workloads" -}}
streams: [metrics]
executor: [metrics]
{{- if .Values.auditSink.enabled }}
audit-sink: [metrics]
{{- end }}
{{- if .Values.api.enabled }}
api: [metrics]
{{- end }}
{{- if .Values.ingest.enabled }}
ingest: [metrics]
{{- end }}
{{- if .Values.slurmProducer.enabled }}
slurm-producer: [metrics]
{{- end }}
{{- with .Values.nodeProducers }}
{{- if and .enabled (or .gpu.enabled .ib.enabled .kernel.enabled .logs.enabled .agent.enabled) }}
node-producers:
  {{- if .gpu.enabled }}
  - metrics-gpu
  {{- end }}
  {{- if .ib.enabled }}
  - metrics-ib
  {{- end }}
  {{- if .kernel.enabled }}
  - metrics-kernel
  {{- end }}
  {{- if .logs.enabled }}
  - metrics-logs
  {{- end }}
  {{- if .agent.enabled }}
  - metrics-agent
  {{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
What `helm test` probes: every enabled long-running component and its probe ports, as YAML
(component: {port name: port}). The node producers' DaemonSet answers through one Service, so a
test reaches one node's pod, not every node's.
*/}}
{{- define "trainmedic.probeTargets" -}}
{{- $v := .Values -}}
streams: {metrics: {{ $v.streams.metricsPort }}}
executor: {metrics: {{ $v.executor.metricsPort }}}
{{- if $v.auditSink.enabled }}
audit-sink: {metrics: {{ $v.auditSink.metricsPort }}}
{{- end }}
{{- if $v.api.enabled }}
api: {metrics: {{ $v.api.metricsPort }}}
{{- end }}
{{- if $v.ingest.enabled }}
ingest: {metrics: {{ $v.ingest.metricsPort }}}
{{- end }}
{{- if $v.notifier.enabled }}
notifier: {metrics: {{ $v.notifier.metricsPort }}}
{{- end }}
{{- if $v.slurmProducer.enabled }}
slurm-producer: {metrics: {{ $v.slurmProducer.metricsPort }}}
{{- end }}
{{- with $v.nodeProducers }}
{{- if and .enabled (or .gpu.enabled .ib.enabled .kernel.enabled .logs.enabled .agent.enabled) }}
node-producers:
  {{- range $name := list "gpu" "ib" "kernel" "logs" "agent" }}
  {{- with index $.Values.nodeProducers $name }}
  {{- if .enabled }}
  metrics-{{ $name }}: {{ .metricsPort }}
  {{- end }}
  {{- end }}
  {{- end }}
{{- end }}
{{- end }}
{{- end }}
