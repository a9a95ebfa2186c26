{{/* The chart's name: also the Prometheus job of the relays (jobLabel). */}}
{{- define "walrelay.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "walrelay.fullname" -}}
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

{{- define "walrelay.selectorLabels" -}}
app.kubernetes.io/name: {{ include "walrelay.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "walrelay.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "walrelay.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: relay
{{- end }}

{{- define "walrelay.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "walrelay.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "walrelay.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
walrelay.flagValue renders a value of `config` as the text of a WALRELAY_*
variable: lists joined with commas (kong's list separator), whole numbers
without the float formatting YAML numbers get in Helm (67108864, not
6.7108864e+07).
*/}}
{{- define "walrelay.flagValue" -}}
{{- $v := . }}
{{- if kindIs "slice" $v }}
{{- $parts := list }}
{{- range $v }}{{ $parts = append $parts (include "walrelay.flagValue" .) }}{{ end }}
{{- join "," $parts }}
{{- else if and (kindIs "float64" $v) (eq (float64 (int64 $v)) $v) }}
{{- int64 $v }}
{{- else }}
{{- toString $v }}
{{- end }}
{{- end }}

{{/*
walrelay.runFlags are the flags of `walrelay run`: a `config` key outside
them is a typo (kong would ignore its variable). deploy/check/chart_test.go
compares the list with `walrelay run --help`.
*/}}
{{- define "walrelay.runFlags" -}}
allow-row-filter alter-publication backoff-max binary brokers checkpoint-topic column-aggregate-id column-aggregate-type column-id column-payload column-traceparent column-tracestate column-type compression confirm-delay cpu-profile create-publication create-slot create-topics dead-letter-topic delivery failover-slot header-column header-id header-type heartbeat-interval heartbeat-query heartbeat-topic idle-advance kafka-aws-region kafka-oauth-audience kafka-oauth-client-id kafka-oauth-client-secret kafka-oauth-client-secret-file kafka-oauth-extension kafka-oauth-scope kafka-oauth-token-file kafka-oauth-token-url kafka-sasl-allow-plaintext kafka-sasl-mechanism kafka-sasl-password kafka-sasl-user kafka-tls kafka-tls-ca kafka-tls-cert kafka-tls-insecure-skip-verify kafka-tls-key kafka-tls-server-name linger log-format log-level max-inflight-bytes max-inflight-events max-message-bytes max-record-bytes max-topic-series max-topics metrics-addr on-invalid pg-aws-iam pg-aws-region pg-password-command pg-url planned-outage preset primary-url publication read-buffer-bytes read-coalesce ready-max-lag receive-timeout record-schema schema-refresh schema-registry-ca schema-registry-password schema-registry-url schema-registry-user shutdown-timeout slot slot-poll-interval snapshot snapshot-order snapshot-where socket-receive-buffer-bytes standby-url startup-timeout status-interval subject-strategy table topic-allow topic-partitions topic-replication-factor topic-template transactional-id txn-max-events txn-max-interval txn-min-interval txn-producers txn-timeout value-format web-config-file
{{- end }}

{{/*
walrelay.ownFlags are the flags other values set (or that carry secrets):
`config` refuses them, so each has one place.
*/}}
{{- define "walrelay.ownFlags" -}}
pg-url brokers metrics-addr slot publication table create-slot delivery transactional-id checkpoint-topic shutdown-timeout kafka-tls kafka-tls-ca kafka-tls-cert kafka-tls-key kafka-tls-server-name kafka-sasl-mechanism kafka-sasl-user kafka-sasl-password kafka-aws-region kafka-oauth-token-url kafka-oauth-client-id kafka-oauth-client-secret kafka-oauth-client-secret-file kafka-oauth-scope kafka-oauth-audience kafka-oauth-extension kafka-oauth-token-file pg-password-command pg-aws-iam pg-aws-region cpu-profile schema-registry-password
{{- end }}

{{/*
walrelay.extensions is kafka.sasl.oauth.extensions as the flag's
KEY=VALUE list, comma-separated, in key order.
*/}}
{{- define "walrelay.extensions" -}}
{{- $kv := list }}
{{- range $k, $v := . }}{{ $kv = append $kv (printf "%s=%s" $k $v) }}{{ end }}
{{- join "," $kv }}
{{- end }}

{{/*
walrelay.goMemLimit is GOMEMLIMIT in bytes: goMemLimit when set, else 85%
of a memory limit given in Mi or Gi; empty for none.
*/}}
{{- define "walrelay.goMemLimit" -}}
{{- $set := .Values.goMemLimit | toString }}
{{- if eq $set "off" }}
{{- else if $set }}
{{- $set }}
{{- else }}
{{- $lim := dig "limits" "memory" "" .Values.resources | toString }}
{{- if regexMatch "^[0-9]+(Mi|Gi)$" $lim }}
{{- $n := regexFind "^[0-9]+" $lim | int64 }}
{{- $unit := ternary 1073741824 1048576 (hasSuffix "Gi" $lim) }}
{{- div (mul $n $unit 85) 100 }}
{{- end }}
{{- end }}
{{- end }}
