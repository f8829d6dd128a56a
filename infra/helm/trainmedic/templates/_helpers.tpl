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

{{- define "trainmedic.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "trainmedic.policyConfigMap" -}}
{{- printf "%s-policy" (include "trainmedic.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Pod metadata and spec fields every component shares. Call with (dict "root" $ "component" "streams").
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
Environment every component gets.
*/}}
{{- define "trainmedic.commonEnv" -}}
- name: TRAINMEDIC_BOOTSTRAP
  value: {{ .Values.kafka.bootstrap | quote }}
- name: PYTHONUNBUFFERED
  value: "1"
{{- end }}

{{/*
The processes write relative paths (Faust's data dir, producer state under var/): their working
directory is a writable emptyDir, as is /tmp, so the root filesystem can stay read-only.
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
Slurm access (executor, Slurm producer): environment, mounts and volumes for slurm.access.
*/}}
{{- define "trainmedic.slurmEnv" -}}
- name: TRAINMEDIC_SLURM_ACCESS
  value: {{ .Values.slurm.access }}
{{- if eq .Values.slurm.access "ssh" }}
- name: TRAINMEDIC_SLURM_SSH_HOST
  value: {{ .Values.slurm.ssh.host | quote }}
- name: TRAINMEDIC_SLURM_SSH_PORT
  value: {{ .Values.slurm.ssh.port | quote }}
- name: TRAINMEDIC_SLURM_SSH_USER
  value: {{ .Values.slurm.ssh.user | quote }}
- name: TRAINMEDIC_SLURM_SSH_KEY
  value: /etc/trainmedic/ssh/id
- name: TRAINMEDIC_SLURM_SSH_KNOWN_HOSTS
  value: /etc/trainmedic/ssh/known_hosts
{{- with .Values.slurm.ssh.passphraseKey }}
- name: TRAINMEDIC_SLURM_SSH_PASSPHRASE
  valueFrom:
    secretKeyRef:
      name: {{ $.Values.slurm.ssh.existingSecret }}
      key: {{ . }}
{{- end }}
{{- with .Values.slurm.ssh.slurmConf }}
- name: TRAINMEDIC_SLURM_SSH_SLURM_CONF
  value: {{ . | quote }}
{{- end }}
{{- else }}
- name: SLURM_CONF
  value: {{ .Values.slurm.inCluster.slurmConf | quote }}
{{- end }}
{{- end }}

{{- define "trainmedic.slurmMounts" -}}
{{- if eq .Values.slurm.access "ssh" -}}
- name: ssh
  mountPath: /etc/trainmedic/ssh
  readOnly: true
{{- else }}
{{- with .Values.slurm.inCluster.volumeMounts }}
{{- toYaml . }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The key is mounted 0440 and owned by root:fsGroup: readable by the pod's user, and OpenSSH
accepts it because the file is not owned by that user.
*/}}
{{- define "trainmedic.slurmVolumes" -}}
{{- if eq .Values.slurm.access "ssh" -}}
- name: ssh
  secret:
    secretName: {{ .Values.slurm.ssh.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.slurm.ssh.privateKeyKey }}
        path: id
      - key: {{ .Values.slurm.ssh.knownHostsKey }}
        path: known_hosts
{{- else }}
{{- with .Values.slurm.inCluster.volumes }}
{{- toYaml . }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Port of the Kafka brokers as the probes see it: kafka.brokerPort, else the first bootstrap entry's.
*/}}
{{- define "trainmedic.kafkaPort" -}}
{{- if .Values.kafka.brokerPort }}
{{- .Values.kafka.brokerPort }}
{{- else }}
{{- splitList "," .Values.kafka.bootstrap | first | trim | splitList ":" | last }}
{{- end }}
{{- end }}

{{/*
Startup, readiness and liveness probes of a Kafka client (see kafkaProbes in values.yaml): an
ESTABLISHED (state 01) connection whose remote port is the broker port, in /proc/net/tcp{,6}.
*/}}
{{- define "trainmedic.kafkaProbes" -}}
{{- $port := include "trainmedic.kafkaPort" . | atoi }}
{{- $exec := dict "exec" (dict "command" (list "sh" "-c" (printf "grep -qs ':%04X 01 ' /proc/net/tcp /proc/net/tcp6" $port))) -}}
startupProbe:
  {{- toYaml (merge (deepCopy $exec) .Values.kafkaProbes.startup) | nindent 2 }}
readinessProbe:
  {{- toYaml (merge (deepCopy $exec) .Values.kafkaProbes.readiness) | nindent 2 }}
livenessProbe:
  {{- toYaml (merge (deepCopy $exec) .Values.kafkaProbes.liveness) | nindent 2 }}
{{- end }}

{{/*
Environment of the node producers: the Kubernetes node's name (the producers' node key) and IP.
*/}}
{{- define "trainmedic.nodeEnv" -}}
- name: TRAINMEDIC_NODE
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: HOST_IP
  valueFrom:
    fieldRef:
      fieldPath: status.hostIP
{{- end }}
