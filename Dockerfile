# walrelay: a static binary on a distroless base.
#
# Base images are pinned by digest (the tag says what an image is, the
# digest which bytes are used), so a rebuilt tag cannot change the build
# unseen. To move to a newer image, read the tag's current digest, e.g.
#   docker buildx imagetools inspect golang:1.26.8-bookworm   (the "Digest:" line)
# and replace both tag and digest in one reviewed commit. The builder's Go
# must be at least go.mod's go line (the image sets GOTOOLCHAIN=local).
FROM golang:1.26.8-bookworm@sha256:a688600ca24f8a4d3ca77f95b0dd40704a9fc787c826660eb7ba0b641b8b175d AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=docker
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -buildid= -X main.version=${VERSION}" -o /walrelay ./cmd/walrelay

# The same image `make image` builds without a container engine
# (deploy/image; its test compares this stage with it): the static binary
# as the numeric nonroot user, `walrelay run`, port 9187, the OCI labels.
FROM gcr.io/distroless/static-debian12:nonroot@sha256:d093aa3e30dbadd3efe1310db061a14da60299baff8450a17fe0ccc514a16639
ARG VERSION=docker
ARG REVISION=unknown
ARG CREATED=1970-01-01T00:00:00Z
LABEL org.opencontainers.image.title="walrelay" \
      org.opencontainers.image.description="PostgreSQL outbox to Kafka relay" \
      org.opencontainers.image.source="https://github.com/walrelay/walrelay" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}"
COPY --from=build /walrelay /walrelay
USER 65532:65532
# --metrics-addr listens on all interfaces by default, which a container
# needs to be scraped; publish the port only where Prometheus reaches it.
EXPOSE 9187
ENTRYPOINT ["/walrelay"]
CMD ["run"]
